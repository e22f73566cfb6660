# frozen_string_literal: true

require "spec_helper"
require "rbspy_ext"
require "rack"
require "tempfile"
require "zlib"

# RubySpy::Rack::Tags on a real Sinatra app served by Puma (spec/fixtures/sinatra_app), and
# RubySpy::Rack::Pprof's access rules called through Rack (the peer address is what a server
# would set; a second address on this machine would need a network namespace).
RSpec.describe RubySpy::Rack do
  describe RubySpy::Rack::Tags do
    def samples_in(profile, label)
      profile.group_by(:endpoint).transform_values do |part|
        part.stacks.sum { |s| s[:frames].any? { |f| f.label == label } ? s[:samples] : 0 }
      end.reject { |_, n| n.zero? }
    end

    it "tags Sinatra routes with method and route, streamed bodies too, and unrouted requests with their path" do
      server = start_server("sinatra_app")
      paths = ["/hello/ann", "/hello/bob", "/stream", "/nowhere"]
      profile = under_load(server, paths, threads: 4, statuses: { "/nowhere" => 404 }) { RubySpy.record(server.pid, rate: 999, duration: 3) }
      # The route's tag is set a few µs before greet_slowly starts. A sample reads the tag
      # pointer before and after the stack in its one call, and keeps the pair only when the
      # pointer held (spy/mod.rs, confirm_tags): no sample of greet_slowly may carry the
      # middleware's path tag.
      greet = samples_in(profile, "Greeter#greet_slowly")
      expect(greet.keys).to eq(["GET /hello/:name"])
      expect(samples_in(profile, "Greeter#chunk_slowly").keys).to eq(["GET /stream"])
      expect(samples_in(profile, "Greeter#wander").keys).to eq(["GET /nowhere"])
      expect(samples_in(profile, "Greeter#greet_slowly").values.sum).to be > 200
      expect(samples_in(profile, "Greeter#chunk_slowly").values.sum).to be > 50
      ids = profile.tags.filter_map { |set| set[:tags][:request_id] }
      expect(ids.uniq.size).to be > 20
    end

    it "runs requests with a W3C traceparent under the caller's trace, named by the route, where no tracer runs" do
      server = start_server("sinatra_app")
      sent = Queue.new
      # A trace of its own for each greeting; the streamed body's requests carry none.
      traceparent = lambda do |path|
        next {} unless path.start_with?("/hello/")

        ids = [Random.bytes(16).unpack1("H*"), Random.bytes(8).unpack1("H*")]
        sent << ids
        { "traceparent" => "00-#{ids[0]}-#{ids[1]}-01" }
      end
      profile = under_load(server, ["/hello/ann", "/stream"], threads: 4, headers: traceparent) do
        RubySpy.record(server.pid, rate: 999, duration: 3)
      end
      parents = Array.new(sent.size) { sent.pop }.to_h
      traced = 0
      profile.group_by(:trace_id).each do |trace_id, part|
        greeting = samples_in(part, "Greeter#greet_slowly").values.sum
        streaming = samples_in(part, "Greeter#chunk_slowly").values.sum
        if trace_id.nil?
          expect(greeting).to eq(0), "#{greeting} samples of a greeting carry no trace"
          next
        end
        expect(parents).to include(trace_id)
        expect(streaming).to eq(0), "a streamed request, which sent no traceparent, under #{trace_id}"
        # The caller's span is the span, and the local root: the one a backend has.
        expect(part.group_by(:span_id).keys).to eq([parents[trace_id]])
        expect(part.group_by(:local_root_span_id).keys).to eq([parents[trace_id]])
        # The path until Sinatra has matched the route, the route from then on.
        expect(part.group_by(:trace_endpoint).keys - ["GET /hello/ann", "GET /hello/:name"]).to eq([])
        routed = samples_in(part.select(trace_endpoint: "GET /hello/:name"), "Greeter#greet_slowly").values.sum
        expect(routed).to eq(greeting)
        traced += greeting
      end
      expect(traced).to be > 200
      traces = profile.group_by(:trace_id).keys.compact.size
      expect(traces).to be > 20
      puts "\n#{traced} samples of greetings under #{traces} of the #{parents.size} traces sent, each its own"
    end

    it "uses the client's X-Request-Id, adds extra tags, and restores the caller's tags after a raising app" do
      seen = nil
      app = ->(env) { seen = RubySpy.tags.dup; env["PATH_INFO"] == "/boom" ? raise("boom") : [200, {}, ["ok"]] }
      tags = RubySpy::Rack::Tags.new(app, extra: ->(env) { { tenant: env["HTTP_X_TENANT"] } })
      RubySpy.tag(outer: 1) do
        tags.call(Rack::MockRequest.env_for("/x", "HTTP_X_REQUEST_ID" => "req-1", "HTTP_X_TENANT" => "acme"))
        expect(seen).to eq(outer: 1, request_id: "req-1", endpoint: "GET /x", tenant: "acme")
        expect { tags.call(Rack::MockRequest.env_for("/boom")) }.to raise_error(RuntimeError, "boom")
        expect(RubySpy.tags).to eq(outer: 1)
      end
      expect { RubySpy::Rack::Tags.new(app, extra: 42) }.to raise_error(TypeError, /extra must respond to #call/)
    end
  end

  describe RubySpy::Rack::Pprof do
    include RubySpyTest::GoPprof

    def get(app, query, env = {})
      status, headers, body = app.call(Rack::MockRequest.env_for("/profile?#{query}", env))
      [status, headers, body.to_enum(:each).to_a.join]
    end

    it "serves loopback peers without a token, refuses others and proxied requests (403)" do
      app = RubySpy::Rack::Pprof.new
      status, headers, body = get(app, "seconds=1", "REMOTE_ADDR" => "127.0.0.1")
      expect([status, headers["content-type"]]).to eq([200, "application/octet-stream"])
      expect(Zlib.gunzip(body).bytesize).to be > 100 # gzipped protobuf
      expect(get(app, "seconds=1", "REMOTE_ADDR" => "::1")[0]).to eq(200)
      expect(get(app, "seconds=1", "REMOTE_ADDR" => "10.1.2.3")[0]).to eq(403)
      expect(get(app, "seconds=1", "REMOTE_ADDR" => "127.0.0.1", "HTTP_X_FORWARDED_FOR" => "203.0.113.9")[0]).to eq(403)
      expect(get(app, "seconds=1", "REMOTE_ADDR" => "127.0.0.1", "HTTP_FORWARDED" => "for=203.0.113.9")[0]).to eq(403)
      # No token configured: a token never opens it.
      expect(get(app, "seconds=1&token=x", "REMOTE_ADDR" => "10.1.2.3")[0]).to eq(403)
    end

    it "serves any peer with the right token, and no loopback peer without it when loopback: false" do
      app = RubySpy::Rack::Pprof.new(token: "s3cret", loopback: false)
      expect(get(app, "seconds=1&token=s3cret", "REMOTE_ADDR" => "10.1.2.3")[0]).to eq(200)
      expect(get(app, "seconds=1", "REMOTE_ADDR" => "10.1.2.3", "HTTP_AUTHORIZATION" => "Bearer s3cret")[0]).to eq(200)
      expect(get(app, "seconds=1", "REMOTE_ADDR" => "127.0.0.1")[0]).to eq(403)
      expect(get(app, "seconds=1&token=s3cre", "REMOTE_ADDR" => "10.1.2.3")[0]).to eq(403)
    end

    it "ends waits for the GVL in a leaf of their own unless state_leaves=0, and takes 0 or 1 only" do
      app = RubySpy::Rack::Pprof.new
      env = { "REMOTE_ADDR" => "127.0.0.1" }
      crunchers = Array.new(2) { Thread.new { loop { Math.sqrt(2.0) } } }
      functions = lambda do |query|
        status, _, body = get(app, query, env)
        expect(status).to eq(200)
        Tempfile.create(["rack", ".pb.gz"]) do |f|
          f.binmode.write(body)
          f.flush
          RubySpyTest::Recording.pprof_functions(f.path)
        end
      end
      expect(functions.("seconds=1")).to include("[waiting for GVL]")
      expect(functions.("seconds=1&state_leaves=0")).not_to include("[waiting for GVL]")
      expect(get(app, "seconds=1&state_leaves=2", env)[0]).to eq(400)
    ensure
      crunchers&.each(&:kill)
    end

    it "serves tracked allocations at /allocs and /heap, and the census at /heap without tracking" do
      app = RubySpy::Rack::Pprof.new
      env = { "REMOTE_ADDR" => "127.0.0.1" }
      read = lambda do |path, query, *args|
        status, headers, body = app.call(Rack::MockRequest.env_for("#{path}?#{query}", env))
        expect([status, headers["content-type"]]).to eq([200, "application/octet-stream"])
        Tempfile.create(["rack", ".pb.gz"]) do |f|
          f.binmode.write(body.join)
          f.flush
          go_pprof("-top", *args, f.path)
        end
      end
      RubySpy.stop_tracking_allocations
      expect(app.call(Rack::MockRequest.env_for("/allocs", env))[0]).to eq(404)
      expect(read.("/heap", "", "-sample_index=inuse_objects")).to match(/^\s*\d+\s.*\sString$/) # the census
      RubySpy.track_allocations(rate: 4096)
      kept = Array.new(20_000) { Object.new }
      allocs = read.("/allocs", "", "-sample_index=alloc_objects", "-tagfocus=class=Object")
      expect(allocs).to match(/Type: alloc_objects/).and match(/Class#new$/)
      heap = read.("/heap", "gc=1", "-sample_index=inuse_objects", "-tagfocus=class=Object")
      expect(heap).to match(/Type: inuse_objects/).and match(/Class#new$/)
      census = read.("/heap", "census=1", "-sample_index=inuse_objects")
      expect(census).to match(/^\s*\d+\s.*\sObject$/)
      expect(app.call(Rack::MockRequest.env_for("/allocs?gc=2", env))[0]).to eq(400)
      expect(app.call(Rack::MockRequest.env_for("/allocs?census=1", env))[0]).to eq(400)
      expect(app.call(Rack::MockRequest.env_for("/heap", env.merge("REMOTE_ADDR" => "10.0.0.1")))[0]).to eq(403)
      expect(kept.size).to eq(20_000)
    ensure
      RubySpy.stop_tracking_allocations
    end

    it "answers what it cannot serve with a reason" do
      app = RubySpy::Rack::Pprof.new
      env = { "REMOTE_ADDR" => "127.0.0.1" }
      expect(app.call(Rack::MockRequest.env_for("/goroutine", env))[0]).to eq(404)
      expect(app.call(Rack::MockRequest.env_for("/profile", env.merge(method: "POST")))[0]).to eq(405)
      expect { RubySpy::Rack::Pprof.new(token: "") }.to raise_error(ArgumentError, /token must not be empty/)
      expect { RubySpy::Rack::Pprof.new(token: 42) }.to raise_error(TypeError, /token must be a String/)
    end
  end
end
