# Parks the main thread in `sleep` under a few frames of different kinds, then a watcher
# thread writes the main thread's own backtrace_locations (TSV: label, path, lineno) to
# ARGV[0] once the main thread sleeps.
module Outer
  class Worker
    def self.run(depth)
      [1].each { |x| new.descend(depth) }
    end

    def descend(depth)
      if depth > 0
        descend(depth - 1)
      else
        3.times do |i|
          park if i == 1
        end
      end
    end

    def park
      main = Thread.current
      Thread.new do
        Thread.pass until main.status == "sleep"
        rows = main.backtrace_locations.map { |l| [l.label, l.path, l.lineno].join("\t") }
        File.write("#{ARGV[0]}.tmp", rows.join("\n") + "\n")
        File.rename("#{ARGV[0]}.tmp", ARGV[0])
      end
      sleep
    end
  end
end

Outer::Worker.run(Integer(ARGV[1] || 5))
