# frozen_string_literal: true

# A large recording in the Firefox Profiler's format: SECONDS (default 60) at 1 kHz over
# THREADS (default 10) threads of a process whose threads run, wait for the GVL and sleep
# in stacks of their own (10 to 40 frames deep), then:
# - the firefox file's size (bytes, and bytes per sample), beside the speedscope timeline of
#   the same profile, and how long writing it took;
# - how long the Firefox Profiler's own code takes to load it (`pq load`: read, gunzip,
#   upgrade, process) and to build one thread's call tree (`pq thread samples`).
#
#   ruby bench/firefox.rb [SECONDS] [THREADS]
#
# Needs the profiler's CLI that script/setup installs (~/.cache/rbspy_ext/profiler-cli).
$LOAD_PATH.unshift(File.expand_path("../lib", __dir__))
require "rbspy_ext"
require "tmpdir"
require_relative "support"
require_relative "../spec/support/profiler_cli"

seconds = Integer(ARGV.fetch(0, "60"))
threads = Integer(ARGV.fetch(1, "10"))
abort "the Firefox Profiler's CLI is not installed: run script/setup" unless RubySpyTest::ProfilerCli.available?

# Each thread recurses through methods of its own to a depth that changes, spins there,
# and sleeps now and then: many distinct stacks, every state but GC most of the time.
target = <<~RUBY
  #{threads}.times do |t|
    Thread.new do
      Thread.current.name = "worker-\#{t}"
      mod = Module.new do
        10.times { |m| define_method(:"step_\#{t}_\#{m}") { |d| d.zero? ? (i = 0; i += 1 while i < 20_000; sleep(0.001) if rand < 0.2) : send(:"step_\#{t}_\#{(m + 1) % 10}", d - 1) } }
      end
      worker = Object.new.extend(mod)
      loop { worker.send(:"step_\#{t}_0", 10 + rand(30)) }
    end
  end
  sleep
RUBY

Dir.mktmpdir("rbspy-firefox-bench") do |dir|
  script = File.join(dir, "threads.rb")
  File.write(script, target)
  pid = spawn(RbConfig.ruby, script)
  sleep 1
  begin
    puts "recording #{threads} threads for #{seconds} s at 1 kHz..."
    profile = RubySpy.record(pid, rate: 1000, duration: seconds)
  ensure
    Process.kill(:KILL, pid)
    Process.wait(pid)
  end
  path = File.join(dir, "large.json.gz")
  started = now
  profile.write(path, format: :firefox)
  written = now - started
  timeline = profile.render(:timeline).bytesize
  size = File.size(path)
  puts format("profile: %d samples, %d threads, %d distinct stacks", profile.samples, profile.threads.size, profile.stacks.size)
  puts format("firefox file: %.2f MB (%.1f bytes a sample), written in %.2f s; " \
              "the speedscope timeline of the same profile: %.2f MB uncompressed",
              size / 1e6, size.fdiv(profile.samples), written, timeline / 1e6)
  RubySpyTest::ProfilerCli.open(path) do |pq|
    puts format("pq load: %.2f s", pq.load_seconds)
    handle = pq.threads.key(pq.threads.values.grep(/\Aworker-0 /).first)
    started = now
    pq.self_samples(handle)
    puts format("pq thread samples (worker-0's call tree): %.2f s", now - started)
  end
end
