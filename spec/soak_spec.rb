# frozen_string_literal: true

require_relative "spec_helper"
require "rbspy_ext"
require "tmpdir"

# The recorder against a target that never holds still (spec/fixtures/soak_churn.rb: threads
# and fibers starting and ending, raises, GC.compact), at 1 kHz for RUBYSPY_SOAK_SECONDS
# (default 60), through the CLI in its own process so its memory can be watched. Neither
# process may crash or hang; every sample must be a stack the target can have, or be counted
# as dropped. The figures are printed for the closing notes.
RSpec.describe "soak: recording a racing target" do
  include RubySpyTest::Recording

  let(:seconds) { Float(ENV.fetch("RUBYSPY_SOAK_SECONDS", "60")) }

  before do
    skip "the target loads rbspy_ext, built for the host Ruby" unless RubySpyTest::TargetRuby.current.host?
  end

  def rss_kb(pid)
    File.read("/proc/#{pid}/status")[/^VmRSS:\s+(\d+)/, 1].to_i
  end

  it "records every thread at 1 kHz without crashing, hanging or leaking, every sample a real stack" do
    target = start_target("soak_churn")
    Dir.mktmpdir("rbspy-soak-") do |dir|
      raw = File.join(dir, "soak.raw")
      log = File.join(dir, "rubyspy.log")
      started = Process.clock_gettime(Process::CLOCK_MONOTONIC)
      recorder = Process.spawn(*rubyspy_command("record", "--pid", target.pid, "--rate", 1000, "--duration", seconds,
                                                "--format", "raw", "--output", raw),
                               in: File::NULL, out: log, err: log)
      elapsed = -> { Process.clock_gettime(Process::CLOCK_MONOTONIC) - started }
      sleep 2
      rss_start = rss_kb(recorder)
      sleep 0.1 until elapsed.call > seconds / 2
      rss_half = rss_kb(recorder)
      sleep 0.1 until elapsed.call > seconds - 1
      rss_end = rss_kb(recorder)
      status = wait_for("rubyspy record to end", timeout: 30, interval: 0.1, raise_on_timeout: false) do
        Process.wait2(recorder, Process::WNOHANG)&.last
      end
      unless status
        Process.kill(:KILL, recorder)
        raise "rubyspy record did not end within 30 s of its duration"
      end
      expect(status.success?).to be(true), "rubyspy record: #{status.inspect}\n#{File.read(log)}"
      expect(target.health_problems).to eq([])

      profile = RubySpy::Profile.load(raw)
      dropped = profile.errors.values.sum
      share = dropped.fdiv(profile.samples + dropped)
      RSpec.configuration.reporter.message(
        format("soak: %.0f s, %d ticks, %d samples, %d dropped (%.3f%%: %s), recorder RSS %d kB at 2 s, " \
               "%d kB at %.0f s, %d kB at %.0f s",
               profile.duration, profile.ticks, profile.samples, dropped, 100 * share, profile.errors,
               rss_start, rss_half, seconds / 2, rss_end, seconds - 1)
      )
      expect(profile.ticks).to be > seconds * 1000 * 0.5
      expect(share).to be < 0.01, "dropped #{dropped} of #{profile.samples + dropped}: #{profile.errors}"
      # Memory: the caches fill up to their bounds (the memo of raw stacks, 8 MB, fills fastest
      # here, every new thread's stacks being at new addresses), then stay there; anything
      # growing with samples would keep growing in the second half.
      expect(rss_end - rss_start).to be < 30_000
      expect(rss_end - rss_half).to be < 5_000

      # Every frame is one the target can have: its own file at a line that exists, rbspy_ext's
      # lib (RubySpy.tag), Ruby's <internal:...> files, or a C function (no path).
      fixture = File.join(RubySpyTest::FIXTURES, "soak_churn.rb")
      lib = File.join(RubySpyTest::ROOT, "lib")
      lines = File.readlines(fixture).size
      frames = profile.stacks.flat_map { |s| s[:frames] }.uniq
      bad = frames.reject do |f|
        path = f.path.to_s
        if path.end_with?("soak_churn.rb") then f.lineno.between?(1, lines)
        else path.empty? || path.start_with?(lib, "<internal:") || f.lineno.to_i.zero?
        end
      end
      expect(bad.map(&:to_s)).to eq([])
      labels = frames.map(&:label)
      expect(labels).to include(a_string_matching(/Churn\.deep/), a_string_matching(/Churn\.work/))
      expect(profile.tags.map { |t| t[:tags] }).to include({ job: "0" }, { job: "4" })
    end
  end
end
