# frozen_string_literal: true

require "zlib"
require_relative "helpers/waiting"

module RubySpyTest
  # Helpers for the recorder and CLI specs.
  module Recording
    module_function

    # Compares "MAJOR.MINOR[.PATCH]" versions: version_at_least?("3.1.2", 3, 1) => true.
    def version_at_least?(version, major, minor)
      (version.to_s.split(".").first(2).map(&:to_i) <=> [major, minor]) >= 0
    end

    # The label RubySpy gives an instance method +name+ of class +klass+ in a profile of a
    # process running Ruby +version+: "Klass#name" on every version (RubySpy qualifies labels
    # itself before 3.4, 3.2's class names behind object shapes included).
    def method_label_pattern(klass, name, _version)
      /\b#{Regexp.escape("#{klass}##{name}")}\b/
    end

    # Records +pid+ (+options+ as for RubySpy::Recorder) until the profile holds at least
    # +samples+ samples, however long that takes, and fails after +timeout+ seconds or when
    # the recording ends by itself first. The BPF sampler samples a thread only while it is on
    # a CPU, so a busy machine gives it fewer samples a second: a spec that needs enough
    # samples for its proportions waits for them rather than for a fixed time.
    def record_until_samples(pid, samples:, timeout: 60, **options)
      recorder = RubySpy::Recorder.new(pid, **options).start
      # On timeout, stopped all the same: the profile's errors and notes say why it fell short.
      Waiting.wait_for("#{samples} samples", timeout: timeout, interval: 0.02, raise_on_timeout: false) do
        !recorder.running? || recorder.progress[:samples] >= samples
      end
      profile = recorder.stop
      unless profile.samples >= samples
        raise "#{profile.samples} samples, not #{samples}, in #{profile.duration.round(2)} s " \
              "(deadline #{timeout} s); errors #{profile.errors}; notes #{profile.notes}"
      end
      profile
    end

    # Seconds thread +tid+ of process +pid+ has spent on a CPU (/proc/PID/task/TID/schedstat,
    # in nanoseconds): what the kernel's CPU clock, and so the BPF sampler, counts for it.
    def thread_cpu_seconds(pid, tid = pid)
      Integer(File.read("/proc/#{pid}/task/#{tid}/schedstat").split.first) / 1e9
    end

    # Folded stacks text -> [[stack, count], ...]; raises on a line that does not parse.
    def parse_collapsed(text)
      text.each_line.map do |line|
        m = /\A(.+) (\d+)\n?\z/.match(line) or raise ArgumentError, "not a collapsed line: #{line.inspect}"
        [m[1], Integer(m[2])]
      end
    end

    # Replays one evented profile of a timeline: every close matches the innermost open frame,
    # times never go back, nothing stays open. The root-first frame names of each moment and
    # how long it lasted, in ms.
    def timeline_spans(doc, index)
      frames = doc["shared"]["frames"].map { |f| f["name"] }
      open = []
      spans = Hash.new(0.0)
      last = 0.0
      doc["profiles"][index]["events"].each do |e|
        expect(e["at"]).to be >= last
        spans[open.map { |f, _| frames[f] }] += e["at"] - last if !open.empty? && e["at"] > last
        last = e["at"]
        if e["type"] == "O"
          open << [e["frame"], e["at"]]
        else
          expect(open.pop&.first).to eq(e["frame"])
        end
      end
      expect(open).to be_empty
      spans
    end

    # Names of the native threads of the calling process (/proc/self/task/*/comm).
    def own_thread_names
      Dir.glob("/proc/self/task/*/comm").map do |path|
        File.read(path).chomp
      rescue SystemCallError
        nil
      end.compact
    end

    # Function names in a gzipped pprof file (Profile.function: field 5, its name: field 2).
    def pprof_functions(path)
      fields, strings = pprof_fields(path)
      fields.select { |n, _, _| n == 5 }.map do |_, _, function|
        strings[ProtobufWire.fields(function).to_h { |n, _, v| [n, v] }.fetch(2).to_i]
      end
    end

    # [key, value] of every string label on every sample of a gzipped pprof file (Sample:
    # field 2, its labels: field 3, a label's key and str: fields 1 and 2).
    def pprof_labels(path)
      fields, strings = pprof_fields(path)
      fields.select { |n, _, _| n == 2 }.flat_map do |_, _, sample|
        ProtobufWire.fields(sample).select { |n, _, _| n == 3 }.map do |_, _, label|
          l = ProtobufWire.fields(label).to_h { |n, _, v| [n, v] }
          [strings[l[1].to_i], strings[l[2].to_i]]
        end
      end.uniq
    end

    # The top-level fields of a gzipped pprof file and its string table (field 6).
    def pprof_fields(path)
      fields = ProtobufWire.fields(Zlib.gunzip(File.binread(path)))
      strings = fields.select { |n, t, _| n == 6 && t == 2 }.map { |_, _, v| v.force_encoding("UTF-8") }
      [fields, strings]
    end

    # A minimal protocol buffers wire-format reader: enough to check that bytes are a
    # well-formed message and to pull out its fields without a .proto compiler.
    module ProtobufWire
      module_function

      # [[field_number, wire_type, value], ...] for the top level of +bytes+. Value is an
      # Integer for varint/fixed fields and a binary String for length-delimited ones.
      # Raises ArgumentError when the bytes are not a well-formed message.
      def fields(bytes)
        bytes = bytes.b
        pos = 0
        out = []
        while pos < bytes.bytesize
          key, pos = varint(bytes, pos)
          number = key >> 3
          type = key & 7
          raise ArgumentError, "field number 0 at byte #{pos}" if number.zero?

          case type
          when 0
            value, pos = varint(bytes, pos)
          when 1
            raise ArgumentError, "fixed64 cut short" if pos + 8 > bytes.bytesize

            value = bytes.byteslice(pos, 8).unpack1("Q<")
            pos += 8
          when 2
            len, pos = varint(bytes, pos)
            raise ArgumentError, "length #{len} runs past the end" if pos + len > bytes.bytesize

            value = bytes.byteslice(pos, len)
            pos += len
          when 5
            raise ArgumentError, "fixed32 cut short" if pos + 4 > bytes.bytesize

            value = bytes.byteslice(pos, 4).unpack1("L<")
            pos += 4
          else
            raise ArgumentError, "wire type #{type} at byte #{pos}"
          end
          out << [number, type, value]
        end
        out
      end

      def varint(bytes, pos)
        value = 0
        shift = 0
        loop do
          raise ArgumentError, "varint cut short" if pos >= bytes.bytesize
          raise ArgumentError, "varint too long" if shift > 63

          byte = bytes.getbyte(pos)
          pos += 1
          value |= (byte & 0x7f) << shift
          shift += 7
          return [value, pos] if byte < 0x80
        end
      end
    end
  end
end
