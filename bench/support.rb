# frozen_string_literal: true

# Shared by the benchmarks: where rbspy (the tool compared against) comes from, and the
# CPU-bound target with its slowdown under a profiler.
require "tmpdir"

# Seconds on the monotonic clock.
def now = Process.clock_gettime(Process::CLOCK_MONOTONIC)

# Process +pid+'s resident memory in MB, or nil once it has gone.
def rss_mb(pid)
  File.read("/proc/#{pid}/status")[/^VmRSS:\s+(\d+)/, 1].to_i / 1024.0
rescue Errno::ENOENT
  nil
end

# The rbspy binary: $RBSPY, or one installed from crates.io into the cache on first use.
def rbspy_binary
  from_env = ENV["RBSPY"]
  return from_env if from_env && File.executable?(from_env)

  root = File.join(ENV.fetch("XDG_CACHE_HOME", File.join(Dir.home, ".cache")), "rbspy_ext", "rbspy")
  bin = File.join(root, "bin", "rbspy")
  unless File.executable?(bin)
    warn "installing rbspy from crates.io into #{root} (one time, a few minutes)"
    system("cargo", "install", "--quiet", "rbspy", "--root", root) or abort "cargo install rbspy failed"
  end
  bin
end

# The command that runs a target Ruby: $TARGET_RUBY (split on spaces, e.g.
# "/opt/srcrubies/4.0/bin/ruby --yjit"), or the Ruby running the benchmark.
def target_ruby
  ENV["TARGET_RUBY"].to_s.split.then { |cmd| cmd.empty? ? [RbConfig.ruby] : cmd }
end

# Runs the CPU-bound target (fixtures_cpu_target.rb, +depth+ levels) for +seconds+, yielding
# its pid once it runs; returns [its iterations per second, what the block returned].
def run_target(seconds, depth: 8)
  Dir.mktmpdir do |dir|
    out = File.join(dir, "rate")
    pid = Process.spawn(*target_ruby, File.join(__dir__, "fixtures_cpu_target.rb"), out, seconds.to_s, depth.to_s)
    sleep 0.01 until File.exist?("#{out}.ready")
    result = yield pid
    Process.wait(pid)
    [Float(File.read(out)), result]
  ensure
    Process.kill(:KILL, pid) rescue nil
    Process.wait(pid) rescue nil
  end
end

# The median of +values+ and a distribution-free 95 % confidence interval for it: the order
# statistics k and n + 1 - k, k the largest with P(Binomial(n, 1/2) < k) <= 2.5 %. It assumes
# nothing of the noise's shape, which on this VM is skewed (steal only ever adds time). Below
# 6 values no such k exists, and the interval is the whole range. Returns [median, low, high].
def median_ci(values)
  a = values.sort
  n = a.size
  below = 0 # P(B <= j - 1), times 2**n
  k = 0
  (0..n).each do |j|
    below += (1..n).reduce(1) { |c, i| i <= j ? c * (n - i + 1) / i : c }
    break if below * 40 > 2**n

    k = j + 1
  end
  low, high = k.zero? ? [a.first, a.last] : [a[k - 1], a[n - k]]
  [a[n / 2], low, high]
end

# The tracker's stats (`RubySpy::NativeAllocations.stats`) since +before+, an earlier call's:
# counters as differences, levels (a price, a margin, a flag) as they are now. Loaded in the
# tracked process itself by bench/alloc_cost.rb and bench/allocs_rails.rb.
STATS_LEVELS = %i[reads_count signal_ns sample_ns ahead_us].freeze
def tracker_stats_since(before)
  RubySpy::NativeAllocations.stats.to_h { |k, v| [k, STATS_LEVELS.include?(k) ? v : v - before.fetch(k, 0)] }
end

def children_cpu
  t = Process.times
  t.cutime + t.cstime
end

# The target's slowdown under a profiler: alone and profiled runs alternate (A P A P ... A),
# each profiled run is compared with the mean of the alone runs on either side of it, and the
# median of those ratios is reported, so that the drifting speed of a shared VM cancels out as
# far as it can. Returns the slowdown and the last profiled run's result.
ROUNDS = Integer(ENV.fetch("ROUNDS", 3))
def profiled(seconds, label)
  alone = [run_target(seconds) { nil }.first]
  seen = []
  result = nil
  ROUNDS.times do
    rate, result = run_target(seconds) { |pid| yield pid }
    seen << rate
    alone << run_target(seconds) { nil }.first
  end
  ratios = seen.each_with_index.map { |r, i| 1 - r / ((alone[i] + alone[i + 1]) / 2) }.sort
  puts format("%s: target alone %s, profiled %s iterations/s", label,
              alone.map { |x| x.round.to_s }.join(" "), seen.map { |x| x.round.to_s }.join(" "))
  [ratios[ratios.size / 2], result]
end
