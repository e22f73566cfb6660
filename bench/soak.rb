# frozen_string_literal: true

# The recorder for a long time at 1 kHz on a target that never holds still
# (spec/fixtures/soak_churn.rb with SOAK_RACTORS=1: short-lived threads, a fiber, a Ractor
# every tenth round, raises, GC.compact every 200 ms), with a heap census of the target
# taken from outside every minute:
#
#   ruby bench/soak.rb [MINUTES]      (default 60)
#
# Prints, for the closing note: samples, dropped samples by reason, threads in the profile,
# the recorder's and the target's RSS after 1 and 5 minutes and at the end, the censuses
# (objects, time), and each process's exit status. Run by hand, not in CI.
$LOAD_PATH.unshift(File.expand_path("../lib", __dir__))
require "rbspy_ext"
require "json"
require "tmpdir"
require "rbconfig"
require_relative "support"

minutes = Float(ARGV.fetch(0, "60"))
root = File.expand_path("..", __dir__)

Dir.mktmpdir("rbspy-soak-") do |dir|
  ready = File.join(dir, "ready")
  target = spawn({ "SOAK_RACTORS" => "1" }, RbConfig.ruby, File.join(root, "spec/fixtures/soak_churn.rb"), ready,
                 err: File.join(dir, "target.log"))
  sleep 0.05 until File.exist?(ready)
  raw = File.join(dir, "soak.raw")
  recorder = spawn(RbConfig.ruby, "-I", File.join(root, "lib"), File.join(root, "exe/rubyspy"), "record",
                   "--pid", target.to_s, "--rate", "1000", "--duration", (minutes * 60).to_s,
                   "--format", "raw", "--output", raw, out: File.join(dir, "rubyspy.log"), err: [:child, :out])
  started = now
  marks = { 1 => nil, 5 => nil }
  censuses = []
  next_census = started + 60
  rc = nil
  until rc
    sleep 1
    elapsed = (now - started) / 60
    marks.each_key do |m|
      marks[m] ||= [rss_mb(recorder), rss_mb(target)] if elapsed >= m
    end
    if now >= next_census
      t = now
      census = RubySpy.heap(target)
      censuses << [census.objects, ((now - t) * 1000).round]
      next_census += 60
    end
    _, status = Process.wait2(recorder, Process::WNOHANG)
    rc = status&.exitstatus
    rss_end = [rss_mb(recorder), rss_mb(target)] unless rc
  end
  target_alive = Process.kill(0, target) && true rescue false # rubocop:disable Style/RescueModifier
  Process.kill(:KILL, target)
  Process.wait(target)
  profile = RubySpy::Profile.load(raw)
  fmt = ->(pair) { pair ? format("recorder %.1f MB, target %.1f MB", *pair) : "n/a" }
  puts "soak of #{minutes} min at 1 kHz (#{RUBY_DESCRIPTION})"
  puts "  recorder exit status #{rc}; target #{target_alive ? "alive at the end" : "DIED"}"
  puts "  samples #{profile.samples} in #{profile.ticks} ticks; dropped #{profile.errors.values.sum}: #{profile.errors}"
  puts "  threads in the profile #{profile.threads.size}; notes: #{profile.notes.join(" | ")}"
  marks.each { |m, pair| puts "  RSS at #{m} min: #{fmt.(pair)}" }
  puts "  RSS at the end: #{fmt.(rss_end)}"
  puts "  censuses (objects, ms): #{censuses.map { |o, ms| "#{o}/#{ms}" }.join(" ")}"
  puts "  log: #{File.read(File.join(dir, "rubyspy.log")).lines.last(3).join.strip}"
end
