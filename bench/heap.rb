# frozen_string_literal: true

# The heap census (RubySpy.heap) against targets on the host's Ruby (or TARGET_RUBY's):
#
#   big:     a heap of at least 1 GB of slots (27 million plain Objects in 40-byte slots on
#            Debian's 3.1, fewer in larger slots elsewhere);
#   small:   10^7 small objects (Strings of 8 bytes, embedded in their slots);
#   ractors: big's 27 million Objects made and kept by four Ractors, 6.75 million each
#            (where each Ractor owns its heap, Ruby master of 2026-08 and later, four heaps;
#            the in-process count then sees the main Ractor's alone).
#
# For each: the census's wall time (median of RUNS) and the bytes it read per second; the
# target's slowdown while censuses run back to back (its own loop's iterations per 50 ms
# tick, during the censuses against the same number of ticks just before); and the time the
# target itself takes for `ObjectSpace.count_objects` plus `ObjectSpace.each_object(Object)
# { n += 1 }`, the in-process way to count (it holds the GVL throughout).
#
#   ruby bench/heap.rb [big|small|ractors|both] (RUNS=5, TARGET_RUBY=/path/to/ruby)
#
# ("both" is big and small.) For example, head beside 4.0:
#
#   TARGET_RUBY=/opt/srcrubies/head/bin/ruby ruby bench/heap.rb big
#   TARGET_RUBY=/opt/srcrubies/4.0/bin/ruby ruby bench/heap.rb big
#
# Run from the repository root after `rake compile`, as root (process_vm_readv).
$LOAD_PATH.unshift File.expand_path("../lib", __dir__)
require "rbspy_ext"
require "json"

RUNS = Integer(ENV.fetch("RUNS", "5"))
TARGET_RUBY = ENV.fetch("TARGET_RUBY", RbConfig.ruby)
SCENARIOS = {
  "big" => "KEEP = Array.new(27_000_000) { Object.new }",
  "small" => "KEEP = Array.new(10_000_000) { |i| (i % 100_000_000).to_s }",
  # Each keeper tells main once its Objects exist (an Integer: nothing to copy), then keeps
  # them, blocked for good.
  "ractors" => <<~'RUBY'
    Warning[:experimental] = false
    KEEPERS = Array.new(3) do
      Ractor.new { keep = Array.new(6_750_000) { Object.new }; Ractor.main.send(1); Ractor.receive; keep.size }
    end
    3.times { Ractor.receive }
    KEEP = Array.new(6_750_000) { Object.new }
  RUBY
}.freeze

# The target: builds its heap, GC.start, then spins a loop that reports its iteration count
# every 50 ms on stdout, and answers "count" on stdin with the in-process census's time.
TARGET = <<~'RUBY'
  %<build>s
  GC.start
  $stdout.sync = true
  Thread.new do
    while (line = $stdin.gets)
      next unless line.start_with?("count")
      t = Process.clock_gettime(Process::CLOCK_MONOTONIC)
      ObjectSpace.count_objects
      n = 0
      ObjectSpace.each_object(Object) { n += 1 }
      puts "count #{Process.clock_gettime(Process::CLOCK_MONOTONIC) - t} #{n}"
    end
  end
  puts "ready #{RUBY_VERSION} #{GC.stat(:heap_live_slots)}"
  n = 0
  tick = Process.clock_gettime(Process::CLOCK_MONOTONIC) + 0.05
  loop do
    n += 1
    next unless (n & 1023).zero? && Process.clock_gettime(Process::CLOCK_MONOTONIC) >= tick
    puts "tick #{n}"
    # Ruby 4.0 never hands the GVL to the count thread woken by stdin while this loop spins:
    # give it the chance once a tick.
    Thread.pass
    n = 0
    tick += 0.05
  end
RUBY

def median(xs) = xs.sort[xs.size / 2]

def ticks(io, seconds)
  deadline = Process.clock_gettime(Process::CLOCK_MONOTONIC) + seconds
  counts = []
  while Process.clock_gettime(Process::CLOCK_MONOTONIC) < deadline
    line = io.gets or break
    counts << line.split.last.to_i if line.start_with?("tick")
  end
  counts
end

def run(name, build)
  io = IO.popen([TARGET_RUBY, "-e", format(TARGET, build: build)], "r+")
  line = io.gets until line&.start_with?("ready")
  version, live = line.split.drop(1)
  live = live.to_i
  ticks(io, 1) # settle
  before = ticks(io, 3)
  times = []
  census = nil
  reader = Thread.new { Thread.current[:during] = ticks(io, 3) }
  deadline = Process.clock_gettime(Process::CLOCK_MONOTONIC) + 3
  while Process.clock_gettime(Process::CLOCK_MONOTONIC) < deadline || times.size < RUNS
    t = Process.clock_gettime(Process::CLOCK_MONOTONIC)
    census = RubySpy.heap(io.pid)
    times << Process.clock_gettime(Process::CLOCK_MONOTONIC) - t
  end
  during = reader.join[:during]
  io.puts "count"
  line = io.gets until line&.start_with?("count")
  own_time, own_objects = line.split[1].to_f, line.split[2].to_i
  Process.kill(:KILL, io.pid)
  io.close
  t = median(times)
  slowdown = 1 - (during.sum.to_f / during.size) / (before.sum.to_f / before.size)
  puts format("%-7s Ruby %s: %12d live slots, %8.1f MB of pages: census %7.1f ms (median of %d; %.2f GB/s), " \
              "%d objects counted; target slowed %.1f%% while censuses ran back to back; " \
              "in-process count_objects + each_object(Object): %7.1f ms (%d objects)",
              name, version, live, census.slots[:heap_bytes_total] / 1e6, t * 1000, times.size,
              census.bytes_read / t / 1e9, census.objects, slowdown * 100, own_time * 1000, own_objects)
end

which = ARGV.fetch(0, "both")
puts "host Ruby #{RUBY_VERSION}, rbspy_ext #{RubySpy::VERSION}, target #{TARGET_RUBY}"
SCENARIOS.each { |name, build| run(name, build) if (which == "both" && name != "ractors") || which == name }
