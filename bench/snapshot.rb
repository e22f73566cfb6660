# frozen_string_literal: true

# Snapshot cost, rbspy_ext against rbspy, on one ~50-frame target in the same run.
#
#   rake compile && ruby bench/snapshot.rb          # installs rbspy with cargo if missing
#   TARGET_RUBY="/opt/srcrubies/4.0/bin/ruby --yjit" ruby bench/snapshot.rb   # another target
#
# Prints: frames, cold RubySpy.snapshot (new handle each time), warm handle#snapshot, the
# process_vm_readv calls per warm snapshot (counted by the memory source), and the wall
# time of `rbspy snapshot --pid` (a fresh process each time, as a user would run it).
$LOAD_PATH.unshift File.expand_path("../lib", __dir__)
require "rbspy_ext"
require "tmpdir"
require_relative "support"

def median(values)
  s = values.sort
  s[s.size / 2]
end

def with_target(mode)
  Dir.mktmpdir do |dir|
    ready = File.join(dir, "ready")
    pid = Process.spawn(*target_ruby, File.join(__dir__, "fixtures_deep_stack.rb"), ready, mode)
    deadline = Time.now + 20
    sleep 0.01 until File.exist?(ready) || Time.now > deadline
    abort "target never became ready" unless File.exist?(ready)
    sleep 0.2 if mode == "spin" # let the loop start
    yield pid
  ensure
    Process.kill(:KILL, pid) rescue nil
    Process.wait(pid) rescue nil
  end
end

def clock
  Process.clock_gettime(Process::CLOCK_MONOTONIC)
end

rbspy = rbspy_binary
%w[park spin].each do |mode|
  with_target(mode) do |pid|
    frames = RubySpy.snapshot(pid)
    colds = Array.new(50) { t = clock; RubySpy.snapshot(pid); clock - t }
    handle = RubySpy.attach(pid)
    handle.snapshot
    n = 20_000
    calls_before = handle.read_calls
    failures = 0
    t = clock
    n.times do
      handle.snapshot
    rescue RubySpy::StackChanged
      failures += 1
    end
    warm = (clock - t) / n
    calls = (handle.read_calls - calls_before).to_f / n
    # rbspy may not know the target's Ruby (4.1.0 here): then ours alone are printed.
    rbspy_times = Array.new(10) do
      t = clock
      out = IO.popen([rbspy, "snapshot", "--pid", pid.to_s], err: File::NULL, &:read)
      break nil unless $?.success?

      @rbspy_frames = out.lines.size
      clock - t
    end
    puts "== target #{mode == 'park' ? 'parked in sleep' : 'spinning (holds the GVL)'}: #{frames.size} frames"
    puts format("  rbspy_ext cold RubySpy.snapshot(pid):  %8.3f ms (median of 50)", median(colds) * 1e3)
    puts format("  rbspy_ext warm handle.snapshot:        %8.1f us (mean of %d; %d retried out)", warm * 1e6, n, failures)
    puts format("  rbspy_ext process_vm_readv per warm:   %8.2f calls", calls)
    unless rbspy_times
      puts "  rbspy snapshot --pid:                  failed (rbspy does not read this Ruby)"
      next
    end
    puts format("  rbspy snapshot --pid (%d lines):       %8.3f ms (median of 10, whole process)",
                @rbspy_frames, median(rbspy_times) * 1e3)
    puts format("  ratio rbspy / rbspy_ext cold:          %8.1fx", median(rbspy_times) / median(colds))
  end
end
