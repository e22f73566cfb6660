# frozen_string_literal: true

# Two Ractors spinning while the main thread sleeps (spec/fixtures/ractor_spinners.rb): what a
# recording says each thread did, beside the CPU the kernel charged each thread over the same
# seconds (/proc/PID/task/TID/stat, utime + stime).
#
#   ruby bench/ractors.rb                       # sid:outside (Debian's 3.4) and 4.0:outside
#   ruby bench/ractors.rb host 3.2:outside      # others, named as RUBYSPY_TARGET_RUBY names them
#   SECONDS=10 RATE=499 DUTY=0.25 ruby bench/ractors.rb
#   MN=1 DUTY=1 ruby bench/ractors.rb head:outside 4.0:outside   # M:N threads
#
# Run from the repository root as root, after `rake compile` and `script/rubies build`.
# spin-a spins without pause; spin-b spins DUTY of the time (default 0.5: 20 ms on, 20 ms
# asleep; 1 for without pause). For each Ruby, two recordings of SECONDS each (user space: every thread at RATE, each state
# from its own Ractor's GVL; then BPF: a thread is sampled when on a CPU), each between two
# readings of every task's CPU time. Per thread: samples by state, the share of ticks in which
# it ran (user space: held its Ractor's GVL; BPF: was on a CPU), and the share of the window it
# spent on a CPU by the kernel's count. The two shares should agree.
$LOAD_PATH.unshift File.expand_path("../lib", __dir__)
require "rbspy_ext"
require "etc"
require "rspec/expectations"
require_relative "../spec/support/frames"
require_relative "../spec/support/target"

SECONDS = Float(ENV.fetch("SECONDS", 5))
RATE = Float(ENV.fetch("RATE", 199))
DUTY = Float(ENV.fetch("DUTY", 0.5))
CLOCK_TICKS = Etc.sysconf(Etc::SC_CLK_TCK)

# CPU seconds of every task of +pid+: {tid => seconds}.
def task_cpu(pid)
  Dir.children("/proc/#{pid}/task").to_h do |tid|
    fields = File.read("/proc/#{pid}/task/#{tid}/stat").split(")").last.split
    # After the command: state is field 3, utime and stime fields 14 and 15 (1-based).
    [Integer(tid), (Integer(fields[11]) + Integer(fields[12])).fdiv(CLOCK_TICKS)]
  rescue SystemCallError
    [Integer(tid), 0.0]
  end
end

def measure(pid, mode)
  before = task_cpu(pid)
  started = Process.clock_gettime(Process::CLOCK_MONOTONIC)
  profile = RubySpy::Recorder.new(pid, rate: RATE, duration: SECONDS, mode: mode).start.wait.stop
  wall = Process.clock_gettime(Process::CLOCK_MONOTONIC) - started
  after = task_cpu(pid)
  cpu = after.to_h { |tid, s| [tid, s - before.fetch(tid, 0.0)] }
  [profile, cpu, wall]
end

def thread_name(t)
  name = t[:name] || (t[:main] ? "main" : "-")
  t[:ractor].to_i > 1 ? "#{name} in #{RubySpy.ractor_text(t)}" : name
end

def report(ruby, mode, profile, cpu, wall)
  puts format("%s, %s: %d ticks in %.2f s at %g Hz, %.1f us per tick, %d dropped",
              ruby, mode, profile.ticks, wall, RATE, profile.cost[:per_tick_us], profile.errors.values.sum)
  # User space samples every thread at each tick; the kernel ticks each CPU RATE times a
  # second and samples the thread on it, so a thread always on a CPU gets RATE a second.
  ticks = mode == :bpf ? RATE * wall : profile.ticks
  puts format("  %-32s %8s  %-44s %9s %9s", "thread", "tid", "samples by state", "ran", "CPU (/proc)")
  seen = []
  profile.threads.sort_by { |t| [t[:ractor].to_i, t[:tid]] }.each do |t|
    seen << t[:tid]
    states = t[:states].sort_by { |_, n| -n }.map { |s, n| "#{s} #{n}" }.join(", ")
    ran = t[:states].sum { |s, n| s == "running" || s == "no_gvl" || s.start_with?("gc") ? n : 0 }
    puts format("  %-32s %8d  %-44s %8.1f%% %8.1f%%", thread_name(t), t[:tid], states,
                100.0 * ran / [ticks, 1].max, 100.0 * cpu.fetch(t[:tid], 0.0) / wall)
  end
  # Tasks no recorded thread names: Ruby's timer thread, idle native threads of M:N, and in
  # BPF mode the threads that never ran.
  (cpu.keys - seen).sort.each do |tid|
    puts format("  %-32s %8d  %-44s %9s %8.1f%%", "(no samples)", tid, "", "", 100.0 * cpu[tid] / wall)
  end
end

specs = ARGV.empty? ? %w[sid:outside 4.0:outside] : ARGV
specs.each do |spec|
  ruby = spec == "host" ? RubySpyTest::TargetRuby.new(nil) : RubySpyTest::TargetRuby.new(spec)
  env = DUTY < 1 ? { "SPIN_B_DUTY" => DUTY.to_s } : {}
  # MN=1 (or 2): M:N threads, where the kernel sampler finds the running Ruby thread through
  # Ruby's ruby_current_ec; a native thread's CPU is then shared by the Ruby threads on it.
  env = env.merge("RUBY_MN_THREADS" => ENV["MN"], "RUBY_MAX_CPU" => "8") if ENV["MN"]
  target = RubySpyTest::Target.start("ractor_spinners", env: env, ruby: ruby)
  begin
    label = "#{spec} (#{target.ruby_version})"
    %i[user bpf].each do |mode|
      report(label, mode, *measure(target.pid, mode))
    end
  ensure
    target.stop
  end
  puts
end
