# frozen_string_literal: true

require_relative "spec_helper"
require "rbspy_ext"
require "open3"

# RubySpy.trace in this process: what it takes, refuses and puts back. What readers outside
# see of it (snapshots, both samplers, gdb, the process context) is spec/otel_spec.rb's,
# where it is one of the two writers; Rack's traceparent is spec/rack_spec.rb's.
RSpec.describe "RubySpy.trace" do
  TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
  SPAN = "00f067aa0ba902b7"

  # The current fiber's OTEP 4947 record, decoded from the OTEP's table, attributes named by
  # the published key map; nil when the fiber has none.
  def record
    bytes = RubySpy::State.current&.otel_record
    bytes && RubySpyTest::OtepRecord.decode(RubySpy::NativeOTel.key_map) { |offset, length| bytes.byteslice(offset, length) }
  end

  it "makes the trace current for the block, with its local root and endpoint, and puts back none after" do
    expect(record&.fetch(:trace_id)).to be_nil
    value = RubySpy.trace(trace_id: TRACE, span_id: SPAN, local_root_span_id: "a3ce929d0e0e4736", endpoint: "orders#show") do
      expect(record).to eq(trace_id: TRACE, span_id: SPAN, valid: 1, flags: 1,
                           attrs: { "trace endpoint" => "orders#show", "local root span id" => "a3ce929d0e0e4736" })
      :done
    end
    expect(value).to eq(:done)
    expect(record).to be_nil
  end

  it "takes ids as Integers, and an unsampled trace" do
    RubySpy.trace(trace_id: TRACE.hex, span_id: SPAN.hex, sampled: false) do
      expect(record).to include(trace_id: TRACE, span_id: SPAN, flags: 0, attrs: {})
    end
  end

  it "nests, keeps the tags set inside and around it, and puts back the outer trace when the block raises" do
    RubySpy.tag(tenant: "acme") do
      RubySpy.trace(trace_id: TRACE, span_id: SPAN) do
        inner = "1" * 16
        expect do
          RubySpy.trace(trace_id: TRACE, span_id: inner) do
            RubySpy.tag(step: 2) do
              expect(record).to include(span_id: inner)
              expect(record[:attrs]).to include("tenant" => "acme", "step" => "2")
              expect(RubySpy.tags).to eq(tenant: "acme", step: 2)
            end
            raise "boom"
          end
        end.to raise_error(RuntimeError, "boom")
        expect(record).to include(span_id: SPAN)
        expect(RubySpy.tags).to eq(tenant: "acme")
      end
      expect(RubySpy.tags).to eq(tenant: "acme")
      expect(record).to include(trace_id: "0" * 32)
    end
  end

  # In a process of its own: the bridge comes on at its first trace, after the tags around it
  # were set, which this process's other examples cannot show once one has traced.
  it "records the tags around the process's first trace once the trace ends" do
    script = <<~RUBY
      require "rbspy_ext"
      require_relative #{File.expand_path("support/otep_record", __dir__).dump}
      decode = lambda do
        bytes = RubySpy::State.current.otel_record
        bytes && RubySpyTest::OtepRecord.decode(RubySpy::NativeOTel.key_map) { |o, l| bytes.byteslice(o, l) }
      end
      RubySpy.tag(tenant: "acme") do
        before = decode.call
        RubySpy.trace(trace_id: "#{TRACE}", span_id: "#{SPAN}") {}
        $stdout.binmode.write(Marshal.dump([before, decode.call]))
      end
    RUBY
    out, err, status = Open3.capture3(RbConfig.ruby, "-I", File.expand_path("../lib", __dir__), "-e", script,
                                      binmode: true)
    expect(status).to be_success, err
    before, after = Marshal.load(out)
    expect(before).to be_nil
    expect(after).to include(trace_id: "0" * 32, attrs: { "tenant" => "acme" })
  end

  it "is inherited by threads and fibers started inside it, and is each fiber's own" do
    RubySpy.trace(trace_id: TRACE, span_id: SPAN) do
      expect(Thread.new { record[:span_id] }.value).to eq(SPAN)
      expect(Fiber.new { record[:span_id] }.resume).to eq(SPAN)
    end
    other = Fiber.new { RubySpy.trace(trace_id: TRACE, span_id: "2" * 16) { Fiber.yield record[:span_id] } }
    expect(other.resume).to eq("2" * 16)
    expect(record).to be_nil
  end

  it "is read from outside: a snapshot of the thread names the trace" do
    ready = Queue.new
    done = Queue.new
    worker = Thread.new do
      Thread.current.name = "traced-worker"
      RubySpy.trace(trace_id: TRACE, span_id: SPAN, local_root_span_id: SPAN, endpoint: "GET /x") do
        ready << true
        done.pop
      end
    end
    ready.pop
    thread = RubySpy.snapshot(Process.pid, threads: :all).find { |t| t[:name] == "traced-worker" }
    expect(thread[:tags]).to include("trace id": TRACE, "span id": SPAN, "local root span id": SPAN,
                                     "trace endpoint": "GET /x")
  ensure
    done << true
    worker&.join
  end

  it "refuses what is not an id, with what it takes" do
    expect { RubySpy.trace(trace_id: TRACE, span_id: SPAN) }.to raise_error(ArgumentError, /needs a block/)
    expect { RubySpy.trace(trace_id: "xyz", span_id: SPAN) {} }.to raise_error(ArgumentError, /trace_id must be 32 hex digits/)
    expect { RubySpy.trace(trace_id: TRACE, span_id: TRACE) {} }.to raise_error(ArgumentError, /span_id must be 16 hex digits/)
    expect { RubySpy.trace(trace_id: "0" * 32, span_id: SPAN) {} }.to raise_error(ArgumentError, /all zeros/)
    expect { RubySpy.trace(trace_id: 1 << 128, span_id: SPAN) {} }.to raise_error(ArgumentError, /below 2\*\*128/)
    expect { RubySpy.trace(trace_id: :id, span_id: SPAN) {} }.to raise_error(TypeError, /hex String or an Integer/)
    expect { RubySpy.trace(trace_id: TRACE, span_id: SPAN, endpoint: 1) {} }.to raise_error(TypeError, /endpoint/)
    expect(record).to be_nil
  end

  # W3C Trace Context's examples and rules for traceparent.
  it "reads W3C traceparent headers, and refuses invalid ones" do
    parse = RubySpy::TraceIds.method(:traceparent)
    expect(parse.call("00-#{TRACE}-#{SPAN}-01")).to eq(trace_id: TRACE, span_id: SPAN, sampled: true)
    expect(parse.call("00-#{TRACE}-#{SPAN}-00")).to eq(trace_id: TRACE, span_id: SPAN, sampled: false)
    # A later version may append fields; its first four are read as version 00's.
    expect(parse.call("cc-#{TRACE}-#{SPAN}-09-what-the-future-holds")).to include(trace_id: TRACE, sampled: true)
    [nil, "", "00-#{TRACE}-#{SPAN}-01-extra", "ff-#{TRACE}-#{SPAN}-01", "00-#{'0' * 32}-#{SPAN}-01",
     "00-#{TRACE}-#{'0' * 16}-01", "00-#{TRACE.upcase}-#{SPAN}-01", "00-#{TRACE}-#{SPAN}", "00-#{TRACE[1..]}-#{SPAN}-01"].each do |bad|
      expect(parse.call(bad)).to be_nil, "#{bad.inspect} was read"
    end
  end
end
