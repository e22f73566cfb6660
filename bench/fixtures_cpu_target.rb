# A CPU-bound target for bench/record.rb: a ~20-frame stack (ARGV[2] levels of 3 frames, 8 by
# default; bench/sample_floor.rb asks for ~200 frames) doing arithmetic, counting its
# own iterations so its speed with and without a profiler can be compared. Writes its
# iteration rate (per second, measured over ARGV[1] seconds) to ARGV[0] when done, and a
# "ready" marker to ARGV[0].ready first.
module Bench
  class Cpu
    def run(depth, seconds)
      depth.zero? ? work(seconds) : [depth].each { |d| run(d - 1, seconds) }
    end

    def work(seconds)
      File.write("#{ARGV[0]}.ready", Process.pid.to_s)
      deadline = Process.clock_gettime(Process::CLOCK_MONOTONIC) + seconds
      iterations = 0
      x = 0
      while Process.clock_gettime(Process::CLOCK_MONOTONIC) < deadline
        1000.times { |i| x = (x + i * 7) % 1_000_003 }
        iterations += 1
      end
      File.write(ARGV[0], (iterations / seconds).to_s)
    end
  end
end

Bench::Cpu.new.run(Integer(ARGV[2] || 8), Float(ARGV[1] || 10))
