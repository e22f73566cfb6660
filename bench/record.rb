# frozen_string_literal: true

# Recorder cost, rbspy_ext against rbspy, on one CPU-bound ~20-frame target, in one run.
#
#   rake compile && ruby bench/record.rb [SECONDS]     # installs rbspy with cargo if missing
#   ROUNDS=5 ruby bench/record.rb                       # more alone/profiled pairs
#   TARGET_RUBY="/opt/srcrubies/4.0/bin/ruby --yjit" ruby bench/record.rb   # another target
#
# Prints, for 1 kHz and 10 kHz: samples taken vs requested, sampler CPU per sample (the
# sampler thread's own CPU clock) and the part of it spent sampling (from wake-up to the end
# of the sample), what merely waking up at that rate costs a thread on this machine
# (core/examples/record.rs idle), process_vm_readv calls per thread per sample, and the
# target's slowdown (its own iteration rate with and without the sampler); the same for
# `rbspy record --nonblocking` (CPU from the kernel's accounting of the rbspy process);
# and the memory of 10^6 aggregated 50-frame samples (core/examples/aggregate_memory.rs).
$LOAD_PATH.unshift File.expand_path("../lib", __dir__)
require "rbspy_ext"
require "tmpdir"
require_relative "support"

SECONDS = Float(ARGV[0] || 5)

rbspy = rbspy_binary
results = {}
[1000, 10_000].each do |rate|
  slowdown, profile = profiled(SECONDS, "rbspy_ext #{rate} Hz") do |pid|
    RubySpy.record(pid, rate: rate, duration: SECONDS - 0.5)
  end
  cost = profile.cost
  requested = rate * profile.duration
  threads = [profile.threads.size, 1].max
  results[rate] = profile
  puts format("rbspy_ext %5d Hz: %d ticks of %.0f requested (%.1f%%), %.2f us CPU per sample " \
              "(%.2f us sampling, the rest waking up), %.2f process_vm_readv per thread per sample, " \
              "target %.2f%% slower, %d errors",
              rate, profile.ticks, requested, 100.0 * profile.ticks / requested, cost[:per_tick_us],
              cost[:sampling_per_tick_us], cost[:read_calls].to_f / profile.ticks / threads,
              100.0 * slowdown, profile.errors.values.sum)
end

# What a thread that only wakes up at these rates costs here (no target, no sampling).
ROOT = File.expand_path("..", __dir__)
wake_us = [1000, 10_000].to_h do |rate|
  line = IO.popen(["cargo", "run", "--quiet", "--release", "-p", "rbspy_ext_core", "--example", "record",
                   "--", "idle", rate.to_s, "3"], chdir: ROOT, &:read)
  puts format("idle thread %5d Hz: %s", rate, line.strip)
  # The same from a periodic timerfd (re-armed by the kernel, no jitter): if this costs about
  # as much, the wake-up itself, not the way the sampler sleeps, sets the floor.
  tfd = IO.popen(["cargo", "run", "--quiet", "--release", "-p", "rbspy_ext_core", "--example", "record",
                  "--", "idle-timerfd", rate.to_s, "3"], chdir: ROOT, &:read)
  puts format("idle thread %5d Hz: %s", rate, tfd.strip)
  [rate, line[/([\d.]+) us CPU per wake-up/, 1].to_f]
end

rbspy_slowdown, rbspy_result = profiled(SECONDS, "rbspy 1000 Hz") do |pid|
  Dir.mktmpdir do |dir|
    file = File.join(dir, "out.txt")
    before = children_cpu
    system(rbspy, "record", "--pid", pid.to_s, "--nonblocking", "--rate", "1000",
           "--duration", (SECONDS - 0.5).to_i.to_s, "--format", "collapsed", "--file", file,
           "--silent", out: File::NULL, err: File::NULL)
    cpu = children_cpu - before
    samples = File.exist?(file) ? File.readlines(file).sum { |l| l.split.last.to_i } : 0
    [cpu, samples]
  end
end
rbspy_cpu, rbspy_samples = rbspy_result
per_sample = rbspy_samples.zero? ? Float::NAN : rbspy_cpu * 1e6 / rbspy_samples
ours = results[1000].cost[:per_tick_us]
puts format("rbspy      1000 Hz: %d samples, %.1f us CPU per sample, target %.2f%% slower",
            rbspy_samples, per_sample, 100.0 * rbspy_slowdown)
puts format("ratio rbspy / rbspy_ext CPU per sample at 1 kHz: %.0fx", per_sample / ours)
ours_work = results[1000].cost[:sampling_per_tick_us]
puts format("ratio without waking up (rbspy minus an idle thread's %.1f us, against rbspy_ext's sampling " \
            "%.2f us): %.0fx", wake_us[1000], ours_work, (per_sample - wake_us[1000]) / ours_work)

system("cargo", "run", "--quiet", "--release", "-p", "rbspy_ext_core", "--example", "aggregate_memory",
       chdir: File.expand_path("..", __dir__))
