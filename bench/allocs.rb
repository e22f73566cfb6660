# frozen_string_literal: true

# What sampled allocation tracking costs (issue 38), beside memory_profiler and stackprof's
# object mode on the same allocation-heavy workload, each run in a Ruby of its own:
# - the fixed cost per allocation (tracking at a rate that never samples: the timer's jobs, and
#   before Ruby 3.3 the GC_END_MARK hook's slow allocation path);
# - the cost per sampled allocation (rate 1: every allocation sampled, less the fixed cost);
# - the slowdown of the workload at several rates, the default among them;
# - stackprof's object mode at its longest interval: nearly the cost of a NEWOBJ hook alone.
#
#   rake compile && ruby bench/allocs.rb [ALLOCATIONS]        # default 3,000,000
#   TARGET_RUBY=/opt/srcrubies/4.0/bin/ruby ruby bench/allocs.rb   # needs script/rubies ext
#
# memory_profiler and stackprof come from Debian (script/setup) and run on the host's Ruby.
require "open3"
require "rbconfig"
require_relative "support"

N = Integer(ARGV.fetch(0, "3000000"))
ROOT = File.expand_path("..", __dir__)
MEMORY_PROFILER = "/usr/share/rubygems-integration/all/gems/memory_profiler-0.9.14/lib"

# The workload: N allocations of a mix of sizes (arrays, strings, objects, hashes), a tenth
# of them kept until the end. Prints the seconds it took under the given tool.
WORKLOAD = <<~'RUBY'
  $LOAD_PATH.unshift(File.join(ENV.fetch("ROOT"), "lib"))
  n = Integer(ENV.fetch("N"))
  work = lambda do |count|
    kept = []
    i = 0
    while i < count
      a = Array.new(3)
      s = "item #{i}"
      o = Object.new
      h = { i => s }
      kept << o if i % 10 == 0
      i += 4
    end
    kept.size + a.size + h.size
  end
  work.call(n / 10) # warm: method caches, constants
  GC.start
  clock = -> { Process.clock_gettime(Process::CLOCK_MONOTONIC) }
  tool = ENV.fetch("TOOL")
  if (rate = tool[/\Arubyspy:(\d+)\z/, 1])
    # Started before the clock and stopped after it: the block form's closing GC is not the
    # workload's.
    require "rbspy_ext"
    RubySpy.track_allocations(rate: Integer(rate))
  end
  started = clock.()
  case tool
  when "none" then work.call(n)
  when /\Arubyspy:/ then work.call(n)
  when "memory_profiler"
    require "memory_profiler"
    MemoryProfiler.report { work.call(n) }
  when /\Astackprof:(\d+)\z/
    require "stackprof"
    StackProf.run(mode: :object, interval: Integer($1)) { work.call(n) }
  end
  puts clock.() - started
RUBY

def run(tool)
  env = { "ROOT" => ROOT, "N" => N.to_s, "TOOL" => tool }
  cmd = [*target_ruby, "-I", MEMORY_PROFILER, "-e", WORKLOAD]
  times = Array.new(3) do
    out, err, status = Open3.capture3(env, *cmd)
    unless status.success?
      warn "#{tool}: #{err.lines.last}"
      return nil
    end
    Float(out.lines.last)
  end
  times.sort[1]
end

base = run("none") or abort "the workload does not run"
never = run("rubyspy:#{1 << 50}")
every = run("rubyspy:1")
puts format("%d allocations, median of 3 runs each, Ruby %s", N, `#{target_ruby.join(" ")} -e 'print RUBY_VERSION'`)
puts format("  %-34s %9.1f ms", "without any tool", base * 1000)
puts format("  %-34s %9.1f ms  %+6.1f%%  (%.1f ns an allocation)", "rbspy_ext tracking, never sampling",
            never * 1000, 100 * (never / base - 1), (never - base) * 1e9 / N)
puts format("  %-34s %9.1f ms  %+6.1f%%  (%.2f us a sample)", "rbspy_ext rate 1 (every allocation)",
            every * 1000, 100 * (every / base - 1), (every - never) * 1e6 / N)
[4096, 32 * 1024, 128 * 1024, 512 * 1024].each do |rate|
  t = run("rubyspy:#{rate}")
  puts format("  %-34s %9.1f ms  %+6.1f%%", "rbspy_ext rate #{rate} bytes", t * 1000, 100 * (t / base - 1))
end
# stackprof's object mode at its longest interval (it refuses more than 999,999) is a NEWOBJ
# hook that nearly only counts: what an always-on allocation hook costs before it does much.
{ "memory_profiler" => "memory_profiler (every allocation)", "stackprof:1" => "stackprof object mode, interval 1",
  "stackprof:999999" => "stackprof object mode, interval 999999" }
  .each do |tool, label|
  t = run(tool)
  next puts(format("  %-34s  could not run", label)) unless t

  puts format("  %-34s %9.1f ms  %+6.1f%%", label, t * 1000, 100 * (t / base - 1))
end
