# frozen_string_literal: true

module RubySpy
  class << self
    # Runs the block with a trace current in this fiber, published for readers outside the
    # process exactly as the OpenTelemetry bridge publishes a span ({OTel}): samples, snapshots
    # and BPF programs reading +otel_thread_ctx_v1+ (OTEP 4947) see the trace, the span, the
    # local root span and the endpoint, and the process context (+OTEL_CTX+, OTEP 4719) is
    # published on first use. For tracers other than OpenTelemetry's (Datadog's, Sentry's, an
    # app's own), and for {Rack::Tags} with a W3C +traceparent+ where no tracer runs. The
    # previous trace (or none) comes back when the block exits, by exception too; tags set
    # inside ({RubySpy.tag}) keep the trace, and threads and fibers created inside start
    # with it.
    #
    # @param trace_id [String, Integer] 32 hex digits (W3C's form) or an Integer below 2**128
    # @param span_id [String, Integer] 16 hex digits or an Integer below 2**64
    # @param local_root_span_id [String, Integer, nil] the first span of this trace in this
    #   process (the request's); nil when there is none to name
    # @param endpoint [String, nil] what the request does ("OrdersController#show")
    # @param sampled [Boolean] the trace's sampled flag (W3C's trace-flags)
    # @return the block's value
    # @raise [ArgumentError] without a block, for an id of the wrong length or not in hex,
    #   or an all-zero id (W3C's invalid one)
    # @raise [TypeError] for an id that is neither a String nor an Integer
    # @example
    #   RubySpy.trace(trace_id: span.trace_id, span_id: span.id, endpoint: "orders#show") { handle }
    def trace(trace_id:, span_id:, local_root_span_id: nil, endpoint: nil, sampled: true)
      raise ArgumentError, "RubySpy.trace needs a block: the trace is current while it runs" unless block_given?

      ids = [TraceIds.bytes(trace_id, 16, "trace_id"), TraceIds.bytes(span_id, 8, "span_id"),
             local_root_span_id.nil? ? nil : TraceIds.bytes(local_root_span_id, 8, "local_root_span_id")]
      raise TypeError, "endpoint must be a String or nil, got #{endpoint.class}" unless endpoint.nil? || endpoint.is_a?(String)

      # Where the spy cannot run (no extension) or with RUBYSPY_OTEL=0, nothing is published.
      return yield unless defined?(NativeOTel) && OTel.publish_once

      previous = State.current
      NativeOTel.trace(ids[0], ids[1], sampled ? 1 : 0, ids[2], endpoint)
      begin
        yield
      ensure
        State.apply(previous)
      end
    end
  end

  # Trace and span ids as the writer takes them (binary Strings).
  # @api private
  module TraceIds
    # +id+ (hex or Integer) as +bytes+ bytes.
    def self.bytes(id, bytes, name)
      binary = case id
               when Integer
                 raise ArgumentError, "#{name} must be below 2**#{bytes * 8}, got #{id}" unless id.between?(0, (1 << (bytes * 8)) - 1)

                 [id.to_s(16).rjust(bytes * 2, "0")].pack("H*")
               when String
                 unless id.match?(/\A\h{#{bytes * 2}}\z/)
                   raise ArgumentError, "#{name} must be #{bytes * 2} hex digits (or an Integer), got #{id.inspect}"
                 end

                 [id].pack("H*")
               else
                 raise TypeError, "#{name} must be a hex String or an Integer, got #{id.class}"
               end
      raise ArgumentError, "#{name} must not be all zeros (W3C's invalid id)" if binary.count("\0") == bytes

      binary
    end

    # W3C Trace Context's +traceparent+: version, trace-id, parent-id, trace-flags, in
    # lowercase hex; a version after 00 may add fields after a dash; ff is never valid.
    TRACEPARENT = /\A(?<version>\h\h)-(?<trace_id>\h{32})-(?<span_id>\h{16})-(?<flags>\h\h)(?<rest>-.*)?\z/

    # A W3C +traceparent+ header ("00-TRACE-PARENT-FLAGS") as
    # +{trace_id:, span_id:, sampled:}+, or nil when it is not a valid one (an all-zero id,
    # upper case, version ff, or a version 00 header with more after it).
    # @param header [String, nil]
    # @return [Hash, nil]
    def self.traceparent(header)
      m = TRACEPARENT.match(header.to_s.strip)
      return nil if m.nil? || m[0].match?(/[A-F]/) || m[:version] == "ff" || (m[:version] == "00" && m[:rest])
      return nil if m[:trace_id].delete("0").empty? || m[:span_id].delete("0").empty?

      { trace_id: m[:trace_id], span_id: m[:span_id], sampled: m[:flags].hex.odd? }
    end
  end
end
