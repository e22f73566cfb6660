# frozen_string_literal: true

module RubySpyTest
  # OTEP 4947's thread record, decoded as the OTEP lays it out (no code of the writer's):
  # trace-id, span-id, valid, trace-flags, attrs-data-size, then {key index, length, bytes}
  # entries, named through the process context's key map.
  module OtepRecord
    HEAD = 28

    # +read+ gives +length+ bytes at +offset+ into the record (from another process's memory,
    # or from a String).
    # @return [Hash] +trace_id:+, +span_id:+ (hex), +valid:+, +flags:+, +attrs:+ (name => text)
    def self.decode(key_map, &read)
      trace_id, span_id, valid, flags, size = read.call(0, HEAD).unpack("a16 a8 C C S")
      data = read.call(HEAD, size)
      attrs = {}
      until data.empty?
        key, length = data.unpack("C C")
        attrs[key_map.fetch(key)] = data.byteslice(2, length).force_encoding(Encoding::UTF_8)
        data = data.byteslice(2 + length..)
      end
      { trace_id: trace_id.unpack1("H*"), span_id: span_id.unpack1("H*"), valid: valid, flags: flags, attrs: attrs }
    end
  end
end
