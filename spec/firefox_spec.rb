# frozen_string_literal: true

require_relative "spec_helper"
require "rbspy_ext"
require "json"
require "net/http"
require "tmpdir"
require "zlib"
require_relative "support/profiler_cli"

# The firefox format (core/src/output/firefox.rs) read by the Firefox Profiler's own code:
# its CLI, pq (spec/support/profiler_cli.rb), loads each file, lists its threads, builds each
# thread's call tree and marker table. Every figure pq gives is checked against the profile
# it came from: thread names, each thread's functions by self samples (our summary's count),
# and the markers' counts, samples and durations against the profile's states, tags and, on
# a Ruby with the OpenTelemetry SDK, the spans the app itself exported. Runs on the host's
# Ruby (Rails 6.1, Puma 5) and inside trixie's chroot (Rails 7.2, Puma 6.6, the SDK).
RSpec.describe "the firefox format, in the Firefox Profiler's own CLI" do
  target_ruby = RubySpyTest::TargetRuby.current

  before do
    skip "the Firefox Profiler's CLI is not installed (script/setup installs it)" unless RubySpyTest::ProfilerCli.available?
  end

  # The file is the same whatever Ruby the target runs: off the host, only the examples of
  # what the host lacks run (Rails 7.2 and Puma 6.6, the OpenTelemetry SDK), which keeps
  # the matrix's longest lane short.
  def host_only
    skip "the format is checked on the host's Ruby; #{RubySpyTest::TargetRuby.current} adds Rails 7.2 and spans" unless RubySpyTest::TargetRuby.current.host?
  end

  around do |example|
    Dir.mktmpdir("rbspy-firefox") do |dir|
      @dir = dir
      example.run
    end
  end

  # +profile+ written as a firefox file, loaded in pq for the block.
  def in_pq(profile, name = "profile")
    path = File.join(@dir, "#{name}.json.gz")
    profile.write(path, format: :firefox)
    RubySpyTest::ProfilerCli.open(path) { |pq| yield pq }
  end

  # The profile's threads that have samples, by the name pq shows (the format's thread name):
  # {name => index in profile.threads}.
  def sampled_threads(profile)
    profile.threads.each_with_index.filter_map do |t, i|
      next unless t[:states].values.sum.positive?

      base = "Thread #{t[:tid].nonzero? || format('%#x', t[:ruby_thread])}"
      ractor = t[:ractor].to_i > 1 ? " in ractor #{t[:ractor]}#{" (#{t[:ractor_name]})" if t[:ractor_name]}" : ""
      named = t[:name] || (t[:main] ? "main" : nil)
      next [t[:name], i] if t[:tid].to_i.zero? && t[:ruby_thread].to_i.zero? # "ended threads"

      [named ? "#{named} (#{base}#{ractor})" : "#{base}#{ractor}", i]
    end.to_h
  end

  # pq's threads, by name, are the profile's sampled threads; {pq handle => profile index}.
  def expect_every_thread(pq, profile)
    listed = pq.threads
    ours = sampled_threads(profile)
    expect(listed.values.sort).to eq(ours.keys.sort)
    listed.to_h { |handle, name| [handle, ours.fetch(name)] }
  end

  # Each thread's functions by self samples in pq equal our summary's for that thread, within
  # 1 % of the thread's samples (by name: pq names a function by its label, as our summary
  # does beside its file).
  def expect_same_self_samples(pq, profile, handles)
    handles.each do |handle, index|
      part = profile.select(thread: index)
      ours = Hash.new(0)
      part.functions.each { |f| ours[f[:label]] += f[:self] }
      ours.delete_if { |_, n| n.zero? }
      theirs = pq.self_samples(handle).reject { |_, n| n.zero? }
      total = part.samples
      (ours.keys | theirs.keys).each do |name|
        expect((ours[name] - theirs.fetch(name, 0)).abs).to be <= 0.01 * total,
                                                            "#{handle} #{name}: ours #{ours[name]}, pq #{theirs[name]}"
      end
      top = ours.max_by(&:last)
      expect(theirs.max_by(&:last)&.first).to eq(top.first) if top && ours.values.count(top.last) == 1
    end
  end

  # The markers of one kind on a thread cover exactly the samples of that state, and last as
  # long as those samples hold: each from its time to the thread's next sample, at most two
  # periods (past that, one: the thread was not sampled in between).
  def expect_state_markers(markers, thread, profile, name:, state:)
    runs = markers.select { |m| m["name"] == name }
    expect(runs.sum { |m| m.dig("data", "samples") }).to eq(thread[:states].fetch(state.to_s, 0)), "#{name} on #{thread[:name]}"
    period_ms = 1000.0 / profile.rate
    runs.each do |m|
      expect(m["duration"]).to be_between(0, m.dig("data", "samples") * 2 * period_ms + 0.01), m.inspect
    end
    expect(runs.sum { |m| m["duration"] }).to be <= profile.duration * 1000 + 2 * period_ms
  end

  # pq's markers of each thread in +handles+, its markers of +states+ ({name => state})
  # checked first: {handle => markers}.
  def markers_checked(pq, profile, handles, states)
    handles.to_h do |handle, index|
      markers = pq.markers(handle)
      states.each { |name, state| expect_state_markers(markers, profile.threads[index], profile, name: name, state: state) }
      [handle, markers]
    end
  end

  it "shows every thread of a Rails app on 5 Puma threads, with each thread's functions, waits and requests" do
    server = start_server("rails_app", env: { "RUBYSPY_PUMA_THREADS" => "5" })
    profile = under_load(server, ["/orders/7", "/invoices"], threads: 8) do
      RubySpy.record(server.pid, rate: 999, duration: 3)
    end
    in_pq(profile, "rails") do |pq|
      handles = expect_every_thread(pq, profile)
      pool = handles.select { |_, i| profile.threads[i][:name].to_s.match?(/\Apuma srv tp \d{3}\z/) }
      expect(pool.size).to eq(5)
      expect_same_self_samples(pq, profile, handles)

      requests = 0
      checked = markers_checked(pq, profile, pool, { "GVL wait" => :waiting_for_gvl, "Blocked" => :blocked })
      pool.each do |handle, index|
        markers = checked.fetch(handle)
        # A request's marker is named after its action and covers that request's samples on
        # this thread: at least one marker per request, as many samples as it had.
        %w[orders#show invoices#index].each do |endpoint|
          part = profile.select(thread: index, endpoint: endpoint)
          ids = part.tags.filter_map { |set| set[:tags][:request_id] if set[:samples].positive? }.uniq
          named = markers.select { |m| m["name"] == endpoint }
          expect(named.sum { |m| m.dig("data", "samples") }).to eq(part.samples)
          expect(named.size).to be >= ids.size
          expect(named.map { |m| m.dig("data", "tags")[/request_id=(\S+)/, 1] }.uniq).to match_array(ids)
          requests += ids.size
        end
      end
      expect(requests).to be > 20
      puts "pq: #{handles.size} threads, #{requests} requests as markers, loaded in #{pq.load_seconds.round(2)} s"
    end
  end

  it "shows the GC's phases and the waits for the GVL as markers that cover the samples in them" do
    host_only
    target = start_target("waits_and_gc")
    profile = RubySpy.record(target.pid, rate: 499, duration: 2)
    in_pq(profile, "gc") do |pq|
      handles = expect_every_thread(pq, profile)
      expect_same_self_samples(pq, profile, handles)
      states = { "GVL wait" => :waiting_for_gvl, "GC marking" => :gc_marking, "GC sweeping" => :gc_sweeping, "GC" => :gc }
      gc_seen = markers_checked(pq, profile, handles, states).values.sum { |ms| ms.count { |m| m["markerType"] == "GC" } }
      expect(gc_seen).to be > 0
      expect(profile.threads.sum { |t| t[:states]["waiting_for_gvl"].to_i }).to be > 100
    end
  end

  it "shows a recording in the kernel (BPF) the same way, saying so, with time on a CPU without the GVL" do
    host_only
    skip "loading BPF programs needs root (CAP_BPF and CAP_PERFMON)" unless Process.uid.zero?

    target = start_target("waits_and_gc")
    profile = RubySpy.record(target.pid, rate: 499, duration: 2, mode: :bpf)
    in_pq(profile, "bpf") do |pq|
      handles = expect_every_thread(pq, profile)
      expect_same_self_samples(pq, profile, handles)
      states = { "GVL wait" => :waiting_for_gvl, "Without GVL" => :no_gvl, "GC marking" => :gc_marking }
      markers_checked(pq, profile, handles, states)
      expect(pq.run("profile", "meta")).to include("Sampler: BPF (in the kernel)")
    end
  end

  it "shows every thread of every Ractor, named with its Ractor" do
    host_only
    skip "Ractors need Ruby 3.0+" if target_ruby.version < Gem::Version.new("3.0")

    target = start_target("ractor_spinners", env: { "RUBY_MAX_CPU" => "8" })
    profile = RubySpy.record(target.pid, rate: 199, duration: 1.5)
    in_pq(profile, "ractors") do |pq|
      handles = expect_every_thread(pq, profile)
      names = pq.threads.values
      expect(names.grep(/\Aspinner-a \(Thread \d+ in ractor \d+ \(spin-a\)\)\z/).size).to eq(1), names.inspect
      expect(names.grep(/\Aspinner-b \(Thread \d+ in ractor \d+ \(spin-b\)\)\z/).size).to eq(1), names.inspect
      expect(profile.threads.map { |t| t[:ractor] }.uniq.size).to eq(3)
      expect_same_self_samples(pq, profile, handles)
    end
  end

  it "is what a scrape of the listener gives with format=firefox, and what rubyspy writes and converts" do
    host_only
    skip "no rbspy_ext built for #{target_ruby}: run script/rubies ext #{target_ruby.name}" unless target_ruby.extension?

    target = start_target("pprof_listener", "contend", ruby: target_ruby.with_proc)
    response = Net::HTTP.get_response(URI("http://127.0.0.1:#{target.info['port']}/debug/pprof/profile?seconds=1&rate=199&format=firefox"))
    expect(response.code).to eq("200"), response.body
    expect(response["content-disposition"]).to include("profile.json.gz")
    scraped = File.join(@dir, "scraped.json.gz")
    File.binwrite(scraped, response.body)
    RubySpyTest::ProfilerCli.open(scraped) do |pq|
      expect(pq.threads.values).to include(a_string_starting_with("crunch-a (Thread "), a_string_starting_with("crunch-b (Thread "))
    end

    raw = File.join(@dir, "cli.raw")
    recorded = File.join(@dir, "cli.json.gz")
    rubyspy!("record", "-p", target.pid.to_s, "-d", "1", "-r", "199", "-f", "firefox", "-o", recorded)
    rubyspy!("record", "-p", target.pid.to_s, "-d", "1", "-r", "199", "-f", "raw", "-o", raw)
    converted = File.join(@dir, "converted.json.gz")
    rubyspy!("report", "--input", raw, "-f", "firefox", "-o", converted)
    profile = RubySpy::Profile.load(raw)
    [recorded, converted].each do |path|
      RubySpyTest::ProfilerCli.open(path) do |pq|
        expect(pq.threads.values).to include(a_string_starting_with("crunch-a (Thread "), a_string_starting_with("crunch-b (Thread "))
        next unless path == converted

        expect_same_self_samples(pq, profile, expect_every_thread(pq, profile))
        # The recording's metadata, in the profile's info panel.
        meta = pq.run("profile", "meta")
        expect(meta).to include("pid: #{target.pid}", "Ruby: #{profile.ruby_version}", "Rate: 199 Hz",
                                "Sampler: user space", "JIT: #{profile.jit || 'none seen'}",
                                "Samples: #{profile.samples.to_s.reverse.scan(/\d{1,3}/).join(',').reverse}")
      end
    end
  end

  describe "traces" do
    before do
      skip "the app is served inside a chroot (RUBYSPY_TARGET_RUBY=trixie:inside), not by #{target_ruby}" unless target_ruby.inside?
      skip "no Rails in #{target_ruby}'s chroot (script/rubies build trixie installs it there)" unless File.exist?(target_ruby.host_path("/usr/bin/rails"))
      missing = RubySpyTest::TargetRuby.otel_sdk_missing
      skip missing if missing
      target_ruby.otel_gem_libs # the app's Gemfile names the SDK's gems where the chroot sees them
    end

    it "shows each request's span as a marker named by its action, over the time the app's span took" do
      target_dir, host_dir = target_ruby.mktmpdir("rbspy-spans")
      server = start_server("rails_otel_app", env: { "RUBYSPY_SPANS" => File.join(target_dir, "spans.jsonl"),
                                                     "OTEL_TRACES_EXPORTER" => "none", "RUBYSPY_PUMA_THREADS" => "5" })
      profile = under_load(server, ["/orders/7", "/invoices"], threads: 6) do
        RubySpy.record(server.pid, rate: 999, duration: 3)
      end
      spans = File.readlines(File.join(host_dir, "spans.jsonl")).map { |line| JSON.parse(line) }
      roots = spans.select { |s| s["parent_span_id"] == "0000000000000000" }.to_h { |s| [s["trace_id"], s] }
      period_ms = 1000.0 / 999
      in_pq(profile, "traces") do |pq|
        # The file's zero, as every reader of it computes times: the recording's start.
        zero_ms = JSON.parse(Zlib.gunzip(File.binread(File.join(@dir, "traces.json.gz")))).dig("meta", "startTime")
        handles = expect_every_thread(pq, profile)
        checked = 0
        close = 0
        handles.each_key do |handle|
          pq.markers(handle).select { |m| m["markerType"] == "Trace" }.each do |m|
            root = roots[m.dig("data", "traceId")]
            expect(root).not_to be_nil, "a marker of trace #{m.dig('data', 'traceId')}, which the app did not export"
            expect(m.dig("data", "spanId")).to eq(root["span_id"])
            # Named by the last new endpoint the span's samples carried: its action once
            # ActionPack routed it ("GET" before, for a request sampled only then).
            endpoints = profile.select(span_id: root["span_id"]).group_by(:trace_endpoint).keys.compact
            action = "#{root.dig('attributes', 'code.namespace')}##{root.dig('attributes', 'code.function')}"
            expect(m["name"]).to eq(endpoints.include?(action) ? action : "GET"), "#{m['name']} for #{endpoints}"
            # Within the span: from a sample after it began to the end of a sample taken
            # before it ended (which holds until the thread's next sample). A sample's time
            # is its tick's start, and the sampler reads a moment later: the recording's first
            # tick reads every thread cold, and a busy machine deschedules the sampler. So
            # every marker lies within 10 ms of its span, and nearly all within two periods.
            span_start = root["start_ns"] / 1e6 - zero_ms
            span_end = root["end_ns"] / 1e6 - zero_ms
            finish = m["start"] + m["duration"]
            expect([m["start"], finish]).to all(be_between(span_start - 10, span_end + 10)), [m, root].inspect
            slack = 2 * period_ms + 1.0
            close += 1 if m["start"] >= span_start - slack && finish <= span_end + slack
            checked += 1
          end
        end
        expect(checked).to be > 20
        expect(close).to be >= 0.9 * checked
        puts "pq: #{checked} span markers, #{close} within two periods of their span"
      end
    end
  end
end
