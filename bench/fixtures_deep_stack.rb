# A target for bench/snapshot.rb: parks (sleep) or spins under a stack of ~50 frames made
# of methods, blocks and C functions. Writes ARGV[0] when ready.
module Bench
  class Deep
    def initialize(mode)
      @mode = mode
    end

    def level(n)
      if n.zero?
        bottom
      elsif n % 5 == 0
        [n].each { |m| level(m - 1) }
      else
        level(n - 1)
      end
    end

    def bottom
      File.write(ARGV[0], Process.pid.to_s)
      if @mode == "spin"
        x = 0
        loop { x += 1 }
      else
        sleep
      end
    end
  end
end

Bench::Deep.new(ARGV[1] || "park").level(Integer(ARGV[2] || 38))
