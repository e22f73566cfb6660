# frozen_string_literal: true

require_relative "spec_helper"
require "rbspy_ext"
require "json"

# OpenTelemetry's context for readers outside (OTEP 4719 and 4947), written by the gem and
# read from outside by the spy and by readers that share no code with it. Two writers publish
# the same records: RubySpy.trace (a tracer of the app's own, everywhere), and the real
# OpenTelemetry SDK through the bridge, which no registry here serves: it runs where a
# developer names a copy kept by hand (RUBYSPY_OTEL_SDK), on Ruby 3.3+, and says why not
# elsewhere. Everything about the records but the bridge runs with either.
RSpec.describe "OpenTelemetry context" do
  include RubySpyTest::Recording
  include RubySpyTest::GoPprof

  let(:ruby) { RubySpyTest::TargetRuby.current }

  before do
    skip "no rbspy_ext built for #{ruby}: run script/rubies ext #{ruby.name}" unless ruby.extension?
  end

  # Which writer the fixture uses: set by each context below.
  def self.writer(name)
    let(:writer) { name }
    return unless name == :sdk

    before do
      skip "the OpenTelemetry SDK needs Ruby 3.3+ (target: #{ruby}, #{ruby.version})" if ruby.version < Gem::Version.new("3.3")
      missing = RubySpyTest::TargetRuby.otel_sdk_missing
      skip missing if missing
    end
  end

  def start_spans(mode, *args, on: ruby)
    env = writer == :sdk ? { "RUBYSPY_OTEL_GEMS" => ruby.otel_gem_libs.join(File::PATH_SEPARATOR) } : {}
    target = start_target("otel_spans", mode, *args, ruby: on, env: env)
    skip target.info["skip"] if target.info["skip"]
    target
  end

  # What the target's memory holds at +address+, +length+ bytes, read as any reader would.
  def peek(pid, address, length)
    File.open("/proc/#{pid}/mem", "rb") do |mem|
      mem.seek(address)
      mem.read(length)
    end
  end

  # A protobuf message's fields as [number, value] pairs, values of length-delimited fields
  # as bytes: written from protobuf's encoding guide, sharing nothing with the extension.
  def proto_fields(bytes)
    io = StringIO.new(bytes)
    varint = lambda do
      shift = 0
      value = 0
      loop do
        byte = io.readbyte
        value |= (byte & 0x7f) << shift
        shift += 7
        break value if byte < 0x80
      end
    end
    fields = []
    until io.eof?
      key = varint.call
      fields << case key & 7
                when 0 then [key >> 3, varint.call]
                when 2 then [key >> 3, io.read(varint.call)]
                when 1 then [key >> 3, io.read(8)]
                when 5 then [key >> 3, io.read(4)]
                else raise "wire type #{key & 7}"
                end
    end
    fields
  end

  # Samples of +profile+ whose stack passes through a frame labelled +label+.
  def samples_through(profile, label)
    profile.stacks.select { |s| s[:frames].any? { |f| f.label == label } }.sum { |s| s[:samples] }
  end

  # Samples of the thread named +name+.
  def thread_samples(profile, name)
    profile.threads.select { |t| t[:name] == name }.sum { |t| t[:states].values.sum }
  end

  # Every sample of each worker, and only its, carries the worker's trace, span and root.
  def expect_worker_traces(target, profile)
    target.info["workers"].each do |w|
      mine = profile.select(trace_id: w["span"]["trace_id"])
      expect(mine.samples).to be > 100
      # All of the worker's samples, and only its: in its span, spinning in its method.
      expect(mine.samples).to eq(thread_samples(profile, w["name"]))
      expect(mine.threads.select { |t| t[:states].values.sum.positive? }.map { |t| t[:name] }).to eq([w["name"]])
      expect(samples_through(mine, "Object#spin_#{w['name'][-1]}")).to eq(mine.samples)
      expect(mine.select(span_id: w["span"]["span_id"]).samples).to eq(mine.samples)
      expect(mine.select(local_root_span_id: w["root"]["span_id"]).samples).to eq(mine.samples)
    end
    expect(profile.group_by(:trace_id).keys.compact.sort).to eq(target.info["workers"].map { |w| w["span"]["trace_id"] }.sort)
  end

  # Each fiber's samples in its own method carry its own span and trace, none the other's,
  # and none goes unlabelled.
  def expect_fiber_spans(target)
    profile = record_until_samples(target.pid, samples: 600, rate: 500)
    by_fiber = target.info["workers"].to_h { |w| [w["name"], w["span"]] }
    %w[a b].each do |name|
      other = (%w[a b] - [name]).first
      own = profile.select(span_id: by_fiber[name]["span_id"])
      expect(samples_through(own, "Object#fiber_#{name}")).to be > 50
      expect(samples_through(own, "Object#fiber_#{other}")).to eq(0),
                                                                "samples in fiber_#{other} labelled with fiber #{name}'s span"
      expect(own.select(trace_id: by_fiber[name]["trace_id"]).samples).to eq(own.samples)
    end
    # Every sample in a fiber's method carries a span: no switch leaves the record behind.
    unlabelled = profile.stacks.select { |s| s[:frames].any? { |f| f.label.start_with?("Object#fiber_") } }.sum { |s| s[:samples] } -
                 %w[a b].sum { |n| samples_through(profile.select(span_id: by_fiber[n]["span_id"]), "Object#fiber_#{n}") }
    expect(unlabelled).to eq(0)
  end

  # The OTEL_CTX mapping of process +pid+ (its maps line) and what it holds, read as OTEP
  # 4719 says: the header (signature, version 2, payload size, publication time, payload
  # address), then the payload, a protobuf Resource, as attribute name => value (an array's
  # values as an Array).
  def process_context(pid)
    maps = File.readlines("/proc/#{pid}/maps")
    ctx = maps.find { |l| l.split[5]&.start_with?("/memfd:OTEL_CTX", "[anon_shmem:OTEL_CTX]", "[anon:OTEL_CTX]") }
    expect(ctx).not_to be_nil, "no OTEL_CTX mapping in:\n#{maps.join}"
    start = Integer(ctx.split("-").first, 16)
    signature, version, size, published_at, payload = peek(pid, start, 32).unpack("a8 L L Q Q")
    expect([signature, version]).to eq(["OTEL_CTX", 2])
    expect(published_at).to be > 0
    attributes = proto_fields(peek(pid, payload, size)).select { |n, _| n == 1 }.to_h do |_, kv|
      fields = proto_fields(kv).to_h
      value = proto_fields(fields[2]).to_h
      [fields[1], value[1] || value[5] && proto_fields(value[5]).map { |_, v| proto_fields(v).to_h[1] }]
    end
    [start, attributes, maps]
  end

  # OTEP 4947's record at +address+ in process +pid+, read as any reader would.
  def otep_record(pid, address, key_map)
    RubySpyTest::OtepRecord.decode(key_map) { |offset, length| peek(pid, address + offset, length) }
  end

  {
    trace_api: "RubySpy.trace (no tracer but the app's own)",
    sdk: "the OpenTelemetry SDK, through the bridge"
  }.each do |name, what|
    context "written by #{what}" do
      writer name

      it "names each thread's trace, span, local root and endpoint in a snapshot" do
        target = start_spans("threads")
        threads = RubySpy.snapshot(target.pid, threads: :all)
        target.info["workers"].each do |w|
          thread = threads.find { |t| t[:name] == w["name"] }
          expect(thread[:tags]).to include(
            "trace id": w["span"]["trace_id"], "span id": w["span"]["span_id"],
            "local root span id": w["root"]["span_id"], "trace endpoint": "GET /spin/#{w['name'][-1]}"
          )
        end
        main = threads.find { |t| t[:main] } || threads.first
        expect(main[:tags].keys).not_to include(:"trace id")
      end

      it "labels every sample of each thread with that thread's trace, read in user space" do
        target = start_spans("threads")
        profile = record_until_samples(target.pid, samples: 600, rate: 500)
        expect_worker_traces(target, profile)
        # The raw format keeps the labels: a saved profile selects the same samples.
        Dir.mktmpdir do |dir|
          path = File.join(dir, "profile.raw")
          File.binwrite(path, profile.render(:raw))
          expect_worker_traces(target, RubySpy::Profile.load(path))
        end
      end

      it "keeps the labels in what the process's own pprof listener serves" do
        # The listener reads its own memory through /proc, which a chroot has only when mounted.
        target = start_spans("threads", "listen", on: ruby.with_proc)
        out = go_pprof("-traces", "http://127.0.0.1:#{target.info['port']}/debug/pprof/profile?seconds=2")
        target.info["workers"].each do |w|
          spinning = traces(out).select { |s| s[:functions].include?("Object#spin_#{w['name'][-1]}") }
          expect(spinning).not_to be_empty
          expect(spinning.map { |s| s[:labels].values_at("trace id", "span id") }.uniq)
            .to eq([[w["span"]["trace_id"], w["span"]["span_id"]]])
        end
      end

      it "labels every sample of each thread with that thread's trace in the kernel too (BPF)" do
        skip "loading BPF programs needs root (CAP_BPF and CAP_PERFMON)" unless Process.uid.zero?

        target = start_spans("threads")
        expect_worker_traces(target, record_until_samples(target.pid, samples: 600, mode: :bpf, rate: 999))
      end

      {
        "fibers" => "two fibers taking turns on one thread",
        "async" => "two Async tasks on one thread (Debian's ruby-async)"
      }.each do |mode, kind|
        it "labels each fiber's samples with its own span: #{kind}" do
          target = start_spans(mode)
          expect_fiber_spans(target)
        end
      end

      it "is read by a reader that knows only the OTEPs: gdb finds otel_thread_ctx_v1 by name, per thread" do
        skip "no gdb (Debian's gdb)" unless system("gdb", "--version", out: File::NULL, err: File::NULL)
        # gdb on the host does not find the files of a process in a chroot by the paths it
        # names them with; the same Ruby run outside the chroot is read instead.
        skip "gdb reads #{ruby} from outside its chroot: the :outside run covers this" if ruby.inside?

        target = start_spans("threads")
        _, attributes, = process_context(target.pid)
        # gdb resolves the TLS variable through glibc's libthread_db, from its .dynsym name
        # alone: the pointer, for every thread (the threads stopped meanwhile, as the OTEP's
        # readers read them).
        out = IO.popen(["gdb", "-p", target.pid.to_s, "-batch", "-iex", "set auto-load safe-path /",
                        "-ex", "thread apply all print/x (unsigned long)otel_thread_ctx_v1"], err: %i[child out], &:read)
        # gdb loads the target glibc's own libthread_db, and Debian 12's gdb cannot use sid's.
        skip "gdb cannot follow this glibc's threads (its libthread_db): #{ruby}" if out.include?("Unable to find libthread_db")
        pointers = out.scan(/^Thread \d+ \(.*?"([^"]*)"\):\n\$\d+ = (0x\h+)$/).to_h { |name, ptr| [name, Integer(ptr)] }
        target.info["workers"].each do |w|
          expect(pointers[w["name"]]).to be_positive, "gdb said:\n#{out}"
          record = otep_record(target.pid, pointers[w["name"]], attributes["threadlocal.attribute_key_map"])
          expect(record).to include(trace_id: w["span"]["trace_id"], span_id: w["span"]["span_id"], valid: 1, flags: 1)
          expect(record[:attrs]).to eq("trace endpoint" => "GET /spin/#{w['name'][-1]}",
                                       "local root span id" => w["root"]["span_id"])
        end
      end

      it "publishes a forked child's own process context, and its threads' traces" do
        target = start_spans("fork")
        child = target.info["child"]
        expect(child).to be_a(Integer)
        _, attributes, = process_context(child)
        expect(attributes["service.name"]).to eq("rbspy-otel-fixture")
        # The parent's mapping is not inherited (MADV_DONTFORK): the child made its own.
        expect(File.read("/proc/#{child}/maps").scan("OTEL_CTX").size).to eq(1)
        worker = target.info["workers"].first
        # The worker spins: a snapshot whose read of its stack kept changing leaves it out, so
        # it is looked for until one has it (seen missing once with two lanes beside it).
        thread = wait_for("the child's worker in a snapshot of every thread") do
          RubySpy.snapshot(child, threads: :all).find { |t| t[:name] == worker["name"] }
        end
        expect(thread[:tags]).to include("trace id": worker["span"]["trace_id"], "span id": worker["span"]["span_id"])
      ensure
        Process.kill(:KILL, child) if child.is_a?(Integer) && (Process.kill(0, child) rescue false)
      end

      it "publishes the process context in an OTEL_CTX mapping, and otel_thread_ctx_v1 as a TLS symbol" do
        target = start_spans("threads")
        start, attributes, maps = process_context(target.pid)
        expect(start).to eq(target.info["otel_ctx"])
        expect(attributes["service.name"]).to eq("rbspy-otel-fixture")
        expect(attributes["threadlocal.schema_version"]).to eq("tlsdesc_v1_dev")
        expect(attributes["threadlocal.attribute_key_map"]).to eq(target.info["key_map"])
        expect(target.info["key_map"].first(2)).to eq(["trace endpoint", "local root span id"])

        so = maps.map { |l| l.split[5] }.compact.find { |p| p.end_with?("rbspy_ext.so") }
        # The path as this process sees it (the kernel names it from the reader's root).
        symbols = IO.popen(["readelf", "--dyn-syms", "--wide", so], &:read)
        expect(symbols.lines.grep(/\botel_thread_ctx_v1$/).first&.split&.at(3)).to eq("TLS")
      end
    end
  end

  describe "in Rails 7.2 on Puma 6.6, with the Rack and ActionPack instrumentations" do
    # Each action's own method (spec/fixtures/rails_app's overlay), and the controller action
    # the instrumentation names.
    OWN = { "OrdersController#price_order" => "OrdersController#show",
            "InvoicesController#total_invoices" => "InvoicesController#index" }.freeze
    # A request, for Puma: from reading it to closing its body. The Rack instrumentation
    # attaches the request's context in its middleware and detaches it when Puma closes the
    # body, after writing the response, within this.
    REQUEST = "Puma::Request#handle_request"
    # Where the SDK ends a span, after taking its end time.
    FINISH = "OpenTelemetry::SDK::Trace::Span#finish"

    writer :sdk

    before do
      skip "the app is served inside a chroot (RUBYSPY_TARGET_RUBY=trixie:inside), not by #{ruby}" unless ruby.inside?
      # The app's Gemfile names the SDK's gems where the chroot sees them.
      ruby.otel_gem_libs
      skip "no Rails in #{ruby}'s chroot (script/rubies build trixie installs it there)" unless File.exist?(ruby.host_path("/usr/bin/rails"))
    end

    # The spans the app exported (one JSON line each), by trace: the request's root span.
    def request_roots(path)
      spans = File.readlines(path).map { |line| JSON.parse(line) }
      spans.select { |s| s["parent_span_id"] == "0000000000000000" }.to_h { |s| [s["trace_id"], s] }
    end

    # Every sample in an action's own method carries its request's trace, the root span's id
    # (the current span: ActionPack names the Rack span rather than opening one) and the
    # controller action; every sample with a trace is inside a request.
    def expect_samples_in_requests(profile, roots)
      in_actions = Hash.new(0)
      profile.group_by(:trace_id).each do |trace_id, by_trace|
        by_trace.group_by(:span_id).each do |span_id, by_span|
          by_span.group_by(:trace_endpoint).each do |endpoint, part|
            part.stacks.each do |stack|
              labels = stack[:frames].map(&:label)
              # Outside a request (a pool thread waiting for one, Puma's reactor): no trace.
              expect(labels).to include(REQUEST), "#{trace_id} on #{labels.reverse.join(' > ')}" if trace_id
              # Nor while the SDK ends the span (its processors export it): past its end time.
              expect(labels).not_to include(FINISH), "#{trace_id} on #{labels.reverse.join(' > ')}" if trace_id
              own = OWN.keys.find { |m| labels.include?(m) }
              next unless own

              root = roots[trace_id]
              expect(root).not_to be_nil, "a sample in #{own} under trace #{trace_id.inspect}, not one the app exported"
              expect([span_id, endpoint]).to eq([root["span_id"], OWN[own]])
              expect("#{root['attributes']['code.namespace']}##{root['attributes']['code.function']}").to eq(OWN[own])
              in_actions[own] += stack[:samples]
            end
          end
        end
      end
      OWN.each_key { |m| expect(in_actions[m]).to be > 50, "#{in_actions[m]} samples in #{m}" }
      in_actions.values.sum
    end

    it "labels every sample inside a request with that request's trace, span and action, in user space and BPF" do
      target_dir, host_dir = ruby.mktmpdir("rbspy-spans")
      server = start_server("rails_otel_app", env: { "RUBYSPY_SPANS" => File.join(target_dir, "spans.jsonl"),
                                                     "OTEL_TRACES_EXPORTER" => "none" })
      user, bpf = under_load(server, ["/orders/7", "/invoices"], threads: 4) do
        [RubySpy.record(server.pid, rate: 999, duration: 3),
         Process.uid.zero? ? RubySpy.record(server.pid, rate: 999, duration: 3, mode: :bpf) : nil]
      end
      roots = request_roots(File.join(host_dir, "spans.jsonl"))
      counted = expect_samples_in_requests(user, roots)
      counted_bpf = bpf ? expect_samples_in_requests(bpf, roots) : 0
      puts "#{counted} samples (user space) and #{counted_bpf} (BPF) in the actions, each under its request's trace"

      # Go's pprof client selects one request's samples by its trace id label.
      trace_id, root = roots.find { |id, _| user.select(trace_id: id).samples >= 3 }
      expect(root).not_to be_nil
      pb = File.join(host_dir, "profile.pb.gz")
      File.binwrite(pb, user.render(:pprof))
      picked = traces(go_pprof("-traces", "-sample_index=samples", "-tagfocus=trace id=#{trace_id}", pb))
      expect(picked.sum { |t| Integer(t[:value]) }).to eq(user.select(trace_id: trace_id).samples)
      # Reported, not counted as 0: a run that is not root checked user space only.
      skip "user space passed; the BPF half needs root (CAP_BPF and CAP_PERFMON)" unless bpf
    end

    it "does the same in each of Puma's workers (workers 2), each publishing its own process context" do
      target_dir, host_dir = ruby.mktmpdir("rbspy-spans")
      server = start_server("rails_otel_app", env: { "RUBYSPY_SPANS" => File.join(target_dir, "spans.jsonl"),
                                                     "OTEL_TRACES_EXPORTER" => "none", "RUBYSPY_WORKERS" => "2" })
      profile = under_load(server, ["/orders/7", "/invoices"], threads: 6, reconnect: true) do
        RubySpy.record(server.pid, rate: 999, duration: 4, subprocesses: true)
      end
      expect_samples_in_requests(profile, request_roots(File.join(host_dir, "spans.jsonl")))
      traced_pids = profile.select(trace_endpoint: "OrdersController#show").threads
                           .select { |t| t[:states].values.sum.positive? }.map { |t| t[:pid] }.uniq
      expect(traced_pids).to match_array(server.workers)
      # Each worker loads the app (this config does not preload it) and publishes its own.
      server.workers.each do |pid|
        _, attributes, = process_context(pid)
        expect(attributes["service.name"]).to eq("rails_otel_app")
      end
    end
  end
end
