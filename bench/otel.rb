# frozen_string_literal: true

# What OpenTelemetry's context for outside readers costs (issue 49; run by hand, figures go
# in notes, not tests):
#
#   script/rubies ext trixie && ruby bench/otel.rb [ROUNDS]      (default 7)
#
# Runs on trixie's Ruby 3.3 (outside its chroot) with the SDK from RUBYSPY_OTEL_SDK (a copy
# kept by hand: no registry here serves it):
# - attach/detach: `OpenTelemetry::Context.with_current(ctx) {}` (an attach and a detach)
#   and `tracer.in_span("x") {}` (a span made, attached, detached, finished), in ns, with
#   the SDK alone, with rbspy_ext loaded and its bridge off (RUBYSPY_OTEL=0), and with the
#   bridge publishing records; the cases alternate OTEL_ROUNDS.times, each in a fresh process;
#   each figure is the median, with its spread;
# - the samplers' cost per sample, with labels and without: spec/fixtures/otel_spans.rb's
#   two threads spinning in spans, recorded 3 s at 999 Hz in user space and in BPF, with
#   the bridge on (records: labels) and off (no records), alternating; µs of sampler CPU per
#   tick (Profile#cost).
require "json"
require "rbconfig"
require_relative "support"

ROOT = File.expand_path("..", __dir__)
OTEL_ROUNDS = Integer(ARGV[0] || 7)
GEMS = Dir[File.join(File.expand_path(ENV.fetch("RUBYSPY_OTEL_SDK", "/nonexistent")), "*", "lib")].sort
abort "no OpenTelemetry gems: RUBYSPY_OTEL_SDK=DIR names a directory of the SDK's gems" if GEMS.empty?
RUBY = [File.join(ROOT, "script", "rubies"), "run", "trixie", "outside", "--chdir", ROOT, "--"].freeze

CHILD = <<~'RUBY'
  require "json"
  require "opentelemetry/sdk"
  OpenTelemetry::SDK.configure
  require "rbspy_ext" unless ENV["CASE"] == "sdk"
  tracer = OpenTelemetry.tracer_provider.tracer("bench")
  span = tracer.start_span("request")
  ctx = OpenTelemetry::Trace.context_with_span(span)
  cpu = -> { Process.clock_gettime(Process::CLOCK_THREAD_CPUTIME_ID, :nanosecond) }
  n = 200_000
  20_000.times { OpenTelemetry::Context.with_current(ctx) {} }
  t = cpu.call
  n.times { OpenTelemetry::Context.with_current(ctx) {} }
  attach = (cpu.call - t).fdiv(n)
  m = 50_000
  5_000.times { tracer.in_span("x") {} }
  t = cpu.call
  m.times { tracer.in_span("x") {} }
  in_span = (cpu.call - t).fdiv(m)
  puts JSON.generate(attach: attach, in_span: in_span, bridge: defined?(RubySpy::OTel) && RubySpy::OTel.installed?)
RUBY

def child(kase)
  env = { "CASE" => kase, "OTEL_TRACES_EXPORTER" => "none", "RUBYSPY_OTEL" => kase == "off" ? "0" : "1" }
  out = IO.popen(env, [*RUBY, "-I#{ROOT}/lib", *GEMS.map { |g| "-I#{g}" }, "-e", CHILD], err: File::NULL, &:read)
  JSON.parse(out.lines.last)
end

def stats(values)
  median, low, high = median_ci(values)
  format("%.0f (%.0f..%.0f)", median, low, high)
end

puts "ruby 3.3 (trixie), #{OTEL_ROUNDS} rounds"
cases = %w[sdk off on]
runs = Hash.new { |h, k| h[k] = [] }
OTEL_ROUNDS.times { cases.shuffle.each { |c| runs[c] << child(c) } }
puts "ns per attach+detach (with_current) and per in_span, median (95 % interval of the median):"
cases.each do |c|
  label = { "sdk" => "SDK alone", "off" => "rbspy_ext, bridge off", "on" => "rbspy_ext, bridge on" }[c]
  puts format("  %-24s attach+detach %-20s in_span %s", label, stats(runs[c].map { |r| r["attach"] }),
              stats(runs[c].map { |r| r["in_span"] }))
end

# The samplers.
require File.join(ROOT, "lib", "rbspy_ext")
def spans_target(bridge)
  ready = File.join(Dir.tmpdir, "rbspy-otel-bench-#{Process.pid}-#{rand(1 << 30)}.json")
  env = { "RUBYSPY_OTEL_GEMS" => GEMS.join(File::PATH_SEPARATOR), "RUBYSPY_OTEL" => bridge ? "1" : "0",
          "OTEL_TRACES_EXPORTER" => "none" }
  pid = Process.spawn(env, *RUBY, File.join(ROOT, "spec/fixtures/otel_spans.rb"), ready, "threads",
                      out: File::NULL, err: File::NULL)
  sleep 0.05 until File.exist?(ready)
  [pid, ready]
end

per_tick = Hash.new { |h, k| h[k] = [] }
labelled = Hash.new { |h, k| h[k] = [] }
OTEL_ROUNDS.times do
  [true, false].shuffle.each do |bridge|
    pid, ready = spans_target(bridge)
    %i[user bpf].each do |mode|
      options = mode == :bpf ? { mode: :bpf } : {}
      profile = RubySpy.record(pid, rate: 999, duration: 3, **options)
      cost = profile.cost
      per_tick[[mode, bridge]] << (mode == :bpf ? cost[:bpf_per_tick_us] + cost[:sampling_per_tick_us] : cost[:sampling_per_tick_us])
      labelled[[mode, bridge]] << profile.tagged(:trace_id).samples.fdiv(profile.samples)
    end
    Process.kill(:KILL, pid)
    Process.wait(pid)
    File.delete(ready)
  end
end
puts "sampler CPU per tick, µs, median (95 % interval), two threads spinning in spans, 999 Hz:"
%i[user bpf].each do |mode|
  [true, false].each do |bridge|
    puts format("  %-4s %-22s %-22s share of samples labelled %.2f", mode, bridge ? "with labels" : "without (bridge off)",
                stats(per_tick[[mode, bridge]]), labelled[[mode, bridge]].sum / labelled[[mode, bridge]].size)
  end
end
