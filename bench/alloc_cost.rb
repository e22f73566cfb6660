# frozen_string_literal: true

# Where sampled allocation tracking's cost goes (issue 48): process CPU of a workload with
# tracking on against off, in windows whose order is shuffled every round, and what the
# tracker's machinery did in the tracked windows (RubySpy::NativeAllocations.stats):
# - slow-path allocations: NEWOBJ hook calls a second, and the share of time the hook is on;
# - wake-ups a second (what asks for the postponed job), jobs a second and µs each;
# - µs a second inside the NEWOBJ hook and the GC_END_MARK hook;
# - JIT code thrown away: YJIT's invalidation_count, ZJIT's invalidation time and
#   compiled iseqs, tracked windows against untracked.
#
# Workloads (each in a process of its own):
#   loop     allocations only: arrays, strings, objects, hashes (bench/allocs.rb's mix)
#   request  a Rack app (Debian's rack 2.2, which runs on every Ruby here) called through
#            Rack::MockRequest and five middlewares: it reads the query, renders an ERB
#            page over 50 rows and their JSON; about 1,000 objects a request
#
#   rake compile && ruby bench/alloc_cost.rb [loop|request] [ROUNDS] [WINDOW_SECONDS]
#   TARGET_RUBY="/opt/srcrubies/4.0/bin/ruby --yjit" ruby bench/alloc_cost.rb request
#   PEERS=stackprof,stackprof:10000,memory_profiler ruby bench/alloc_cost.rb request 7 3
#
# Defaults: request, 7 rounds, 1 s windows, tracking as `RubySpy.track_allocations` does
# (512 KiB, at most 100 samples a second). RATE=524288 tracks at a rate given (no cap),
# CAP=0 or CAP=1000 sets the cap. Each figure is the median over rounds, with the spread
# (lowest and highest) beside it; the round-by-round cost also with a 95 % interval for its
# median, which narrows with rounds (30 rounds make it about ±1 % here). Every window first
# runs WARMUP seconds (default 1) untimed: tracking's first second, before the budget has
# priced a sample, is not what it costs when left on.
#
# PEERS adds the tools people use today to the same rounds, each a window of its own in the
# shuffled order, priced against the same untracked windows: `stackprof` (object mode, its
# default interval of 1: every allocation), `stackprof:N` (every Nth allocation), and
# `memory_profiler` (MemoryProfiler.start/stop; the window times the work, not the report
# that `stop` then builds). They must load in the target's Ruby (host: script/setup installs
# ruby-stackprof and ruby-memory-profiler).
require "json"
require "open3"
require_relative "support"

workload = ARGV.fetch(0, "request")
rounds = Integer(ARGV.fetch(1, "7"))
window = Float(ARGV.fetch(2, "1"))
abort "workload: loop or request" unless %w[loop request].include?(workload)

RUN = <<~'RUBY'
  $LOAD_PATH.unshift(File.join(ENV.fetch("ROOT"), "lib"))
  require "rbspy_ext"
  require File.join(ENV.fetch("ROOT"), "bench", "support")
  require "erb"
  require "json"
  options = ENV["RATE"].to_s.empty? ? {} : { rate: Integer(ENV["RATE"]) }
  options[:max_samples_per_second] = Integer(ENV["CAP"]) unless ENV["CAP"].to_s.empty?
  rounds = Integer(ENV.fetch("ROUNDS"))
  peers = ENV.fetch("PEERS").split(",")
  require "stackprof" if peers.any? { |p| p.start_with?("stackprof") }
  require "memory_profiler" if peers.include?("memory_profiler")
  window = Float(ENV.fetch("WINDOW"))

  $LOAD_PATH.unshift(ENV.fetch("RACK_LIB"))
  require "rack"
  require "rack/mock"
  ROWS = Array.new(50) { |i| { id: i, name: "item #{i}", price: i * 1.5, tags: %w[a b c] } }
  # Compiled once into a method, as Rails compiles its templates: `result_with_hash` evals
  # the template's source at every call, so each request made a new iseq, and with a JIT on
  # compiling them was most of the work (601 requests a second under YJIT, 4,717 without).
  module Page
    extend self
  end
  ERB.new(<<~HTML).def_method(Page, "render(rows)")
    <ul><% rows.each do |r| %><li id="<%= r[:id] %>"><%= r[:name] %> <%= format("%.2f", r[:price]) %>
    <%= r[:tags].join(",") %></li><% end %></ul>
  HTML
  unit = case ENV.fetch("WORKLOAD")
         when "loop"
           lambda do
             kept = []
             i = 0
             while i < 4000
               a = Array.new(3)
               s = "item #{i}"
               o = Object.new
               h = { i => s }
               kept << o if i % 10 == 0
               i += 4
             end
             kept.size + a.size + h.size
           end
         else
           app = Rack::Builder.new do
             use Rack::Runtime
             use Rack::ContentLength
             use Rack::ETag
             use Rack::ConditionalGet
             use Rack::Head
             run(lambda do |env|
               request = Rack::Request.new(env)
               limit = Integer(request.params.fetch("limit", "50"))
               rows = ROWS.first(limit).map { |r| r.merge(seen: true) }
               html = Page.render(rows)
               [200, { "content-type" => "text/html", "x-json" => JSON.generate(rows).size.to_s }, [html]]
             end)
           end.to_app
           mock = Rack::MockRequest.new(app)
           lambda do
             response = mock.get("/catalog?limit=50&page=2")
             raise "status #{response.status}" unless response.status == 200

             response.body.size
           end
         end
  cpu = -> { Process.clock_gettime(Process::CLOCK_PROCESS_CPUTIME_ID) }
  mono = -> { Process.clock_gettime(Process::CLOCK_MONOTONIC) }
  # Units in a window: as many as fit in WINDOW seconds untracked, measured once.
  200.times { unit.() }
  GC.start
  started = mono.()
  n = 0
  (unit.(); n += 1) while mono.() - started < window
  objects = GC.stat(:total_allocated_objects)
  n.times { unit.() }
  per_unit = (GC.stat(:total_allocated_objects) - objects).fdiv(n)
  warm = (n * Float(ENV.fetch("WARMUP")) / window).round

  jit = lambda do
    if defined?(RubyVM::YJIT) && RubyVM::YJIT.enabled?
      s = RubyVM::YJIT.runtime_stats
      { "yjit invalidations" => s[:invalidation_count].to_i, "yjit iseqs compiled" => s[:compiled_iseq_count].to_i }
    elsif defined?(RubyVM::ZJIT) && RubyVM::ZJIT.enabled?
      s = RubyVM::ZJIT.stats
      # Side exits are counted only under --zjit-stats (TARGET_RUBY="... --zjit --zjit-stats").
      { "zjit invalidation ms" => s[:invalidation_time_ns].to_i / 1e6, "zjit iseqs compiled" => s[:compiled_iseq_count].to_i,
        "zjit side exits" => s[:side_exit_count].to_i,
        "zjit exits at the NEWOBJ patch point" => s[:exit_patchpoint_no_newobj_hook].to_i }
    else
      {}
    end
  end
  windows = []
  rounds.times do
    (%w[none tracked] + peers).shuffle.each do |tool|
      GC.start
      case tool
      when "tracked" then RubySpy.track_allocations(**options)
      when /\Astackprof(?::(\d+))?\z/ then StackProf.start(mode: :object, interval: Integer(Regexp.last_match(1) || 1))
      when "memory_profiler" then MemoryProfiler.start
      end
      # Tracking is measured as it runs when left on: its first second takes samples at the
      # cap until the budget has priced a sample (SAMPLES_FIRST_LOOK), then settles. The
      # warm-up, the same in every window, is not timed, and the stats count from its end.
      warm.times { unit.() }
      warm_stats = tool == "tracked" ? RubySpy::NativeAllocations.stats : {}
      before_jit = jit.()
      t = cpu.()
      n.times { unit.() }
      t = cpu.() - t
      case tool
      when /\Astackprof/ then StackProf.stop && StackProf.results
      when "memory_profiler" then MemoryProfiler.stop
      end
      row = { "tool" => tool, "cpu" => t, "jit" => jit.().to_h { |k, v| [k, v - before_jit.fetch(k, 0)] } }
      if tool == "tracked"
        row["stats"] = tracker_stats_since(warm_stats).transform_keys(&:to_s)
        RubySpy.stop_tracking_allocations
      end
      windows << row
    end
  end
  puts JSON.generate(ruby: RUBY_DESCRIPTION, units: n, per_unit: per_unit, windows: windows)
RUBY

RACK_LIB = ENV.fetch("RACK_LIB") { Dir["/usr/share/rubygems-integration/all/gems/rack-2*/lib"].max }
abort "no rack 2: apt install ruby-rack (script/setup does), or RACK_LIB=dir" unless RACK_LIB

peers = ENV.fetch("PEERS", "").split(",")
unknown = peers.grep_v(/\A(?:stackprof(?::[1-9]\d*)?|memory_profiler)\z/)
abort "PEERS: #{unknown.join(', ')}: stackprof, stackprof:N or memory_profiler" if unknown.any?
env = { "ROOT" => File.expand_path("..", __dir__), "RATE" => ENV.fetch("RATE", ""), "CAP" => ENV.fetch("CAP", ""),
        "PEERS" => peers.join(","),
        "RACK_LIB" => RACK_LIB,
        "WARMUP" => ENV.fetch("WARMUP", "1"), "ROUNDS" => rounds.to_s, "WINDOW" => window.to_s, "WORKLOAD" => workload }
out, err, status = Open3.capture3(env, *target_ruby, "-e", RUN)
abort "the workload failed: #{err}" unless status.success?
result = JSON.parse(out.lines.last)

median = ->(a) { a.sort[a.size / 2] }
spread = ->(a) { format("%+.1f..%+.1f", a.min, a.max) }
by_tool = result["windows"].group_by { |w| w["tool"] }
none = by_tool["none"].map { |w| w["cpu"] }
tracked = by_tool["tracked"]
# Each round's tracked window against the median untracked one.
cost = tracked.map { |w| 100.0 * (w["cpu"] / median.(none) - 1) }
puts result["ruby"]
puts format("%s: %d units a window (%.0f objects each) after %s s of warm-up, rate %s, cap %s, %d rounds", workload,
            result["units"], result["per_unit"], env["WARMUP"], env["RATE"].empty? ? "default" : env["RATE"],
            env["CAP"].empty? ? "default" : env["CAP"], rounds)
puts format("  CPU a window: untracked %.3f s, tracked %.3f s: %+.1f %% (spread %s)", median.(none),
            median.(tracked.map { |w| w["cpu"] }), median.(cost), spread.(cost))
# Each round's tracked window against the same round's untracked one, so that a drift of the
# machine's speed moves both; with many rounds the interval says what the noise still allows.
paired_cost = tracked.zip(by_tool["none"]).map { |t, u| 100.0 * (t["cpu"] / u["cpu"] - 1) }
puts format("  paired, round by round: %+.2f %% (95 %% interval for the median %+.2f..%+.2f, %d pairs)",
            *median_ci(paired_cost), paired_cost.size)
# This VM's noise only adds CPU time (steal, interrupts): the quietest window of each kind is
# the steadier estimate of what the work costs, and the quietest tenth of each the check on it.
lowest = ->(a, share) { a.sort.first([(a.size * share).ceil, 1].max).sum / [(a.size * share).ceil, 1].max }
tracked_cpu = tracked.map { |w| w["cpu"] }
puts format("  CPU, the quietest window of each: %+.2f %%; the mean of the quietest tenth: %+.2f %%",
            100.0 * (tracked_cpu.min / none.min - 1), 100.0 * (lowest.(tracked_cpu, 0.1) / lowest.(none, 0.1) - 1))
# (A counter an older tracker lacks reads 0.)
stat = ->(w, key) { w["stats"].fetch(key, 0) }
per_s = ->(key) { median.(tracked.map { |w| stat.(w, key) / stat.(w, "seconds") }) }
each_us = lambda do |ns, count|
  median.(tracked.map { |w| stat.(w, count).positive? ? stat.(w, ns) / stat.(w, count) / 1000 : 0 })
end
armed = median.(tracked.map { |w| 100.0 * w["stats"]["armed_ns"] / (w["stats"]["seconds"] * 1e9) })
puts format("  samples %.0f/s; slow-path allocations (hook calls) %.0f/s; hook on %.1f %% of the time, " \
            "turned on %.0f/s (%.1f µs a turn on and off)", per_s.("samples"), per_s.("hook_calls"), armed,
            per_s.("arms"), each_us.("switch_ns", "arms"))
puts format("  wake-ups %.0f/s, %.1f µs each in the handler; timer set %.0f/s; jobs %.0f/s at %.1f µs each; " \
            "points missed %.1f/s; publications %.1f/s at %.0f µs each", per_s.("wakes"),
            each_us.("handler_ns", "wakes"), per_s.("timer_sets"), per_s.("jobs"),
            each_us.("job_ns", "jobs"), per_s.("missed"), per_s.("publishes"), each_us.("publish_ns", "publishes"))
puts format("  inside the NEWOBJ hook %.0f µs/s; GC_END_MARK %.1f calls/s at %.1f µs each",
            per_s.("hook_ns") / 1000, per_s.("marks"), each_us.("mark_ns", "marks"))
# What the tracker spent as the CPU budget (core/src/allocs/budget.rs) prices it: the jobs'
# and hook's own time, the slow path, a wake-up at what the tracker timed for its signal.
priced = ->(w) { 100.0 * stat.(w, "priced_ns") / (stat.(w, "seconds") * 1e9) }
puts format("  holds of the hook while ZJIT compiles: %.0f a window, %.0f ms", median.(tracked.map { |w| stat.(w, "holds") }),
            median.(tracked.map { |w| stat.(w, "held_ms") }))
puts format("  the tracker's own measure: %.2f %% of a core (spread %s); a sample %.0f µs, a wake-up %.1f µs",
            median.(tracked.map(&priced)), spread.(tracked.map(&priced)).delete("+"),
            median.(tracked.map { |w| stat.(w, "sample_ns") / 1000 }), median.(tracked.map { |w| stat.(w, "signal_ns") / 1000 }))
# The peers, against the same untracked windows.
peers.each do |peer|
  cost = by_tool.fetch(peer).map { |w| 100.0 * (w["cpu"] / median.(none) - 1) }
  puts format("  %s: CPU a window %.3f s: %+.1f %% (spread %s)", peer, median.(by_tool[peer].map { |w| w["cpu"] }),
              median.(cost), spread.(cost))
end
jit_keys = result["windows"].flat_map { |w| w["jit"].keys }.uniq
jit_keys.each do |k|
  puts format("  %s a window: untracked %s, tracked %s", k, median.(by_tool["none"].map { |w| w["jit"][k] }),
              median.(tracked.map { |w| w["jit"][k] }))
end
