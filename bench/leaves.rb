# frozen_string_literal: true

# Waits for the GVL billed as work, or not (issue 37): two threads loop over Math.sqrt and so
# each holds the GVL about half the time, which the kernel counts as their CPU time. Each
# profile's share of the crunching threads' samples billed to program frames (self samples
# of anything but a state leaf) is compared with that CPU share, for rbspy_ext with leaves,
# rbspy_ext without (the shape before them) and rbspy (--nonblocking), recorded one after
# the other on the same target. Then what the leaves cost a rendering: each format of the
# recording, with and without them.
#
#   rake compile && ruby bench/leaves.rb [SECONDS]      # installs rbspy with cargo if missing
#   TARGET_RUBY=/opt/srcrubies/4.0/bin/ruby ruby bench/leaves.rb
$LOAD_PATH.unshift File.expand_path("../lib", __dir__)
require "rbspy_ext"
require "tmpdir"
require_relative "support"

SECONDS = Float(ARGV.fetch(0, "5"))
TARGET = <<~RUBY
  def crunch; loop { 1_000.times { |i| Math.sqrt(i) } }; end
  threads = 2.times.map { |i| Thread.new { Thread.current.name = "crunch-\#{i}"; crunch } }
  File.write(ARGV[0], "")
  threads.each(&:join)
RUBY
LEAVES = ["[waiting for GVL]", "[GC]", "[GC marking]", "[GC sweeping]", "[GC compacting]"].freeze

def clock
  Process.clock_gettime(Process::CLOCK_MONOTONIC)
end

# Seconds on a CPU of the target's crunching threads (/proc/PID/task/TID/schedstat), by tid.
def cpu_seconds(pid)
  Dir.glob("/proc/#{pid}/task/*").to_h do |task|
    next [nil, 0] unless File.read("#{task}/comm").start_with?("crunch-")

    [File.basename(task), Integer(File.read("#{task}/schedstat").split.first) / 1e9]
  end.except(nil)
end

# The share of a collapsed profile's samples of the crunching threads (stacks through
# Object#crunch) whose innermost frame is the program's, not a state leaf.
def billed_share(collapsed)
  crunching = collapsed.lines.map { |l| l.rpartition(" ") }.select { |stack, _, _| stack.include?("crunch") }
  total = crunching.sum { |_, _, n| Integer(n) }
  work = crunching.reject { |stack, _, _| LEAVES.include?(stack.split(";").last) }.sum { |_, _, n| Integer(n) }
  [work.fdiv(total), total]
end

def measured(pid)
  before = cpu_seconds(pid)
  started = clock
  result = yield
  wall = clock - started
  cpu = cpu_seconds(pid).sum { |tid, s| s - before.fetch(tid, 0) }
  [result, cpu / (2 * wall)]
end

rbspy = rbspy_binary
Dir.mktmpdir do |dir|
  ready = File.join(dir, "ready")
  pid = Process.spawn(*target_ruby, "-e", TARGET, ready)
  sleep 0.01 until File.exist?(ready)
  sleep 0.5
  profile, cpu_ours = measured(pid) { RubySpy.record(pid, rate: 999, duration: SECONDS) }
  collapsed = File.join(dir, "rbspy.collapsed")
  _, cpu_rbspy = measured(pid) do
    system(rbspy, "record", "--pid", pid.to_s, "--nonblocking", "--rate", "999", "--duration", SECONDS.ceil.to_s,
           "--format", "collapsed", "--file", collapsed, "--silent", out: File::NULL, err: File::NULL)
  end
  Process.kill(:KILL, pid)
  Process.wait(pid)

  puts "Ruby #{profile.ruby_version}, #{SECONDS} s at 999 Hz each; two threads crunching Math.sqrt"
  puts format("%-28s %12s %10s %14s", "", "billed share", "samples", "CPU share")
  leaves, n = billed_share(profile.render(:collapsed))
  puts format("%-28s %11.1f%% %10d %13.1f%%", "rbspy_ext (leaves)", 100 * leaves, n, 100 * cpu_ours)
  bare, n = billed_share(profile.render(:collapsed, state_leaves: false))
  puts format("%-28s %11.1f%% %10d %13.1f%%", "rbspy_ext --no-state-leaves", 100 * bare, n, 100 * cpu_ours)
  if File.exist?(collapsed)
    theirs, n = billed_share(File.read(collapsed))
    puts format("%-28s %11.1f%% %10d %13.1f%%", "rbspy --nonblocking", 100 * theirs, n, 100 * cpu_rbspy)
  else
    puts "rbspy could not record Ruby #{profile.ruby_version}"
  end
  sqrt = profile.functions.find { |f| f[:label] == "Math.sqrt" }
  sqrt_bare = profile.functions(state_leaves: false).find { |f| f[:label] == "Math.sqrt" }
  puts format("Math.sqrt self samples: %d with leaves, %d without", sqrt[:self], sqrt_bare[:self])

  puts
  puts format("Rendering the %d samples (%d stacks), median of 9, ms:", profile.samples, profile.stacks.size)
  puts format("  %-12s %10s %10s", "format", "leaves", "without")
  %i[summary collapsed flamegraph speedscope pprof callgrind timeline].each do |format|
    times = [true, false].map do |leaves_on|
      Array.new(9) do
        t = clock
        profile.render(format, state_leaves: leaves_on)
        clock - t
      end.sort[4] * 1000
    end
    puts format("  %-12s %10.2f %10.2f", format, *times)
  end
end
