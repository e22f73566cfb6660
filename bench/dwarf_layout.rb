# frozen_string_literal: true

# What reading a layout from a target's own debug information costs (core/src/dwarf/):
# the first attach, which reads the DWARF, against a later one that finds the layout kept by
# build-id under the cache directory, and against the table's layout (force_version), each
# in a fresh process (so no layout is kept in memory), with that process's peak memory.
# rbspy's snapshot of the same target, whole process, for scale, and whether it read all
# eight frames.
#
#   ruby bench/dwarf_layout.rb [ROUNDS]     # default 5 rounds per Ruby
#
# Run from the repository root as root, after `rake compile` and `script/rubies build`:
# every Ruby `script/rubies list` names whose binary has .debug_info.
require_relative "support"
require "json"
require "open3"

LAYOUT_ROUNDS = Integer(ARGV.fetch(0, "5"))
ROOT = File.expand_path("..", __dir__)

rubies = IO.popen([File.join(ROOT, "script", "rubies"), "list"], &:read).lines.map(&:split)
           .select { |f| IO.popen(["readelf", "-S", f[3]], err: File::NULL, &:read).include?(".debug_info") }
abort "no Ruby with debug information here: script/rubies build" if rubies.empty?

# One attach in a fresh process: [seconds the attach took, peak RSS in MB after it, source].
def attach_once(pid, env, force = nil)
  script = <<~RUBY
    require "rbspy_ext"
    hwm = -> { File.read("/proc/self/status")[/^VmHWM:\\s+(\\d+)/, 1].to_i / 1024.0 }
    before = hwm.call
    t = Process.clock_gettime(Process::CLOCK_MONOTONIC)
    handle = RubySpy.attach(#{pid}#{force ? ", force_version: #{force.dump}" : ""})
    took = Process.clock_gettime(Process::CLOCK_MONOTONIC) - t
    print [took, hwm.call, hwm.call - before, handle.layout[:source], handle.layout[:cached]].inspect
  RUBY
  out, err, status = Open3.capture3(env, RbConfig.ruby, "-I", File.join(ROOT, "lib"), "-e", script)
  abort "attach failed: #{err}" unless status.success?
  eval(out) # rubocop:disable Security/Eval: our own child's Array of numbers and symbols
end

def median(values) = values.sort[values.size / 2]

rbspy = rbspy_binary
puts format("%-12s %-7s %-28s %9s %9s %9s", "ruby", "version", "attach", "median ms", "max ms", "peak +MB")
rubies.each do |name, version, _dir, bin, kind|
  # Eight frames: sleep, six of Object#a, <main>.
  target = spawn(bin, "-e", "def a(n) = n.zero? ? sleep : a(n - 1); a(5)", pgroup: true)
  sleep 1
  Dir.mktmpdir("rbspy-layout-bench-") do |cache|
    rows = { "debug info, first" => [], "debug info, cached" => [], "table (force_version)" => [] }
    LAYOUT_ROUNDS.times do
      FileUtils.rm_rf(Dir[File.join(cache, "*")])
      rows["debug info, first"] << attach_once(target, { "RUBYSPY_LAYOUT_CACHE" => cache })
      rows["debug info, cached"] << attach_once(target, { "RUBYSPY_LAYOUT_CACHE" => cache })
      rows["table (force_version)"] << attach_once(target, { "RUBYSPY_LAYOUT_CACHE" => "0" }, version) if kind == "source"
    end
    rows.each do |label, runs|
      next if runs.empty?

      ms = runs.map { |r| r[0] * 1000 }
      puts format("%-12s %-7s %-28s %9.1f %9.1f %9.1f", name, version, "#{label} (#{runs.first[3]})", median(ms), ms.max,
                  median(runs.map { |r| r[2] }))
    end
    times = Array.new(LAYOUT_ROUNDS) do
      t = now
      out, status = Open3.capture2e(rbspy, "snapshot", "--pid", target.to_s)
      # rbspy exits 0 when it cannot read the stack, and may print part of it: a read is all
      # eight frames.
      [now - t, status.success? && out.lines.count { |l| l.include?("Object#a") } == 6 && out.include?("<main>")]
    end
    ok = times.count { |_, s| s }
    puts format("%-12s %-7s %-28s %9.1f %9.1f %9s", name, version, "rbspy snapshot (whole run)", median(times.map { |t, _| t * 1000 }),
                times.map { |t, _| t * 1000 }.max, "#{ok}/#{LAYOUT_ROUNDS} read")
  end
ensure
  Process.kill("KILL", -target) if target
end
