# frozen_string_literal: true

# The BPF sampler's cost, all in, against the user-space sampler and rbspy, on the CPU-bound
# target of bench/record.rb (a ~30-frame stack), in one run. Root only.
#
#   rake compile && ruby bench/bpf.rb [SECONDS]      # installs rbspy with cargo if missing
#   ROUNDS=5 ruby bench/bpf.rb                        # more alone/profiled pairs
#
# For 1 kHz and 10 kHz, per sample kept:
# - recorder: CPU of the recorder's thread (its own clock: draining, resolving, waking up);
# - kernel: the program's run time from bpf_stats (kernel.bpf_stats_enabled, switched on by
#   the recording), every run counted, other processes' ticks that it filtered out included;
# - interrupt: what the tick itself costs the code it interrupts, which bpf_stats does not
#   see: a C-level loop (Rust, pinned to CPU 0) with and without the program loaded for a
#   pid no process has, on the same events (core/examples/record.rs interrupt), as CPU per
#   tick. On a VM this is mostly the hypervisor's cost of a timer interrupt;
# and samples taken against requested, the target's slowdown under each sampler, and the same
# figures for the user-space sampler and for rbspy (1 kHz only: it cannot keep 10 kHz).
$LOAD_PATH.unshift File.expand_path("../lib", __dir__)
require "rbspy_ext"
require_relative "support"

abort "bench/bpf.rb loads BPF programs: run it as root" unless Process.uid.zero?

SECONDS = Float(ARGV[0] || 5)
ROOT = File.expand_path("..", __dir__)
system("cargo", "build", "--quiet", "--release", "-p", "rbspy_ext_core", "--example", "record",
       chdir: ROOT) or abort "building core/examples/record.rs failed"
EXAMPLE = File.join(ENV.fetch("CARGO_TARGET_DIR", File.join(ROOT, "target")), "release", "examples", "record")

# What a tick costs the code it interrupts (core/examples/record.rs interrupt), with a
# sleeping Ruby to take the layout from: a loop pinned to CPU 0 with and without the program
# loaded for no process, alternating, the median slowdown.
def interrupt_cost(rate)
  pid = Process.spawn(RbConfig.ruby, "-e", "sleep")
  sleep 0.3
  IO.popen([EXAMPLE, "interrupt", pid.to_s, rate.to_s, "11"], &:read)
ensure
  Process.kill(:KILL, pid) rescue nil
  Process.wait(pid) rescue nil
end

def frames_per_sample(profile)
  n = profile.stacks.sum { |s| s[:samples] }
  n.zero? ? 0.0 : profile.stacks.sum { |s| s[:frames].size * s[:samples] }.to_f / n
end

def line(what, rate, profile, slowdown)
  requested = rate * profile.duration
  format("%-9s %5d Hz: %6d samples of %6.0f requested (%5.1f%%), %4.1f frames a sample, %6.2f us recorder CPU " \
         "per sample, target %5.2f%% slower", what, rate, profile.samples, requested,
         100.0 * profile.samples / requested, frames_per_sample(profile), profile.cost[:per_tick_us],
         100.0 * slowdown)
end

summary = []
# A tick costs the same whatever the rate, but at 1 kHz its share of a loop's time (0.1-3 %)
# drowns in this VM's noise (a few %): measured at 10 kHz, where it is ten times larger.
interrupt = interrupt_cost(10_000)
[1000, 10_000].each do |rate|
  record = SECONDS - 0.5
  bpf_slowdown, bpf = profiled(SECONDS, "bpf #{rate} Hz") do |pid|
    RubySpy::Recorder.new(pid, rate: rate, duration: record, mode: :bpf).start.wait.stop
  end
  user_slowdown, user = profiled(SECONDS, "user-space #{rate} Hz") do |pid|
    RubySpy::Recorder.new(pid, rate: rate, duration: record).start.wait.stop
  end
  cost = bpf.cost
  interrupt_us = [interrupt[/([-\d.]+) us per tick/, 1].to_f, 0.0].max
  all_in = cost[:per_tick_us] + cost[:bpf_per_tick_us] + interrupt_us
  summary << line("bpf", rate, bpf, bpf_slowdown)
  summary << format("%-9s %5d Hz: %.2f us per sample in the kernel (%d runs of %.2f us), %d wake-ups; %s",
                    "", rate, cost[:bpf_per_tick_us], cost[:bpf_runs], cost[:bpf_per_run_us], cost[:wakeups],
                    interrupt.strip)
  summary << format("%-9s %5d Hz: ALL IN %.2f us per sample (recorder %.2f + kernel %.2f + interrupt %.2f)",
                    "bpf", rate, all_in, cost[:per_tick_us], cost[:bpf_per_tick_us], interrupt_us)
  summary << line("user", rate, user, user_slowdown)
  # Like for like: what each profiler's own code costs. Both samplers also pay a timer
  # interrupt per sample (the user-space one to wake its thread), which neither figure holds.
  ours = cost[:per_tick_us] + cost[:bpf_per_tick_us]
  summary << format("%-9s %5d Hz: user-space recorder / bpf recorder + kernel: %.1fx (bpf all in: %.1fx)",
                    "", rate, user.cost[:per_tick_us] / ours, user.cost[:per_tick_us] / all_in)
  next unless rate == 1000

  rbspy = rbspy_binary
  rbspy_slowdown, (cpu, samples) = profiled(SECONDS, "rbspy #{rate} Hz") do |pid|
    Dir.mktmpdir do |dir|
      file = File.join(dir, "out.txt")
      before = children_cpu
      system(rbspy, "record", "--pid", pid.to_s, "--nonblocking", "--rate", rate.to_s,
             "--duration", record.to_i.to_s, "--format", "collapsed", "--file", file,
             "--silent", out: File::NULL, err: File::NULL)
      [children_cpu - before, File.exist?(file) ? File.readlines(file).sum { |l| l.split.last.to_i } : 0]
    end
  end
  per_sample = samples.zero? ? Float::NAN : cpu * 1e6 / samples
  summary << format("%-9s %5d Hz: %6d samples, %.1f us CPU per sample, target %.2f%% slower; " \
                    "rbspy / bpf recorder + kernel: %.0fx (bpf all in: %.0fx)",
                    "rbspy", rate, samples, per_sample, 100.0 * rbspy_slowdown,
                    per_sample / (cost[:per_tick_us] + cost[:bpf_per_tick_us]), per_sample / all_in)
end
puts summary
