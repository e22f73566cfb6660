# frozen_string_literal: true

require_relative "spec_helper"
require "rbspy_ext"
require "tmpdir"
require_relative "support/profiler_cli"

# A recording of a process that keeps starting threads stays bounded: past
# RubySpy's 256 threads, threads that ended are merged into one "ended threads" thread
# (core/src/profile/retire.rs), their samples kept.
RSpec.describe "recording a process that keeps starting threads" do
  include RubySpyTest::Recording

  before { skip "the aggregator is the same for every Ruby: checked on the host's" unless RubySpyTest::TargetRuby.current.host? }

  it "merges threads that ended into one, past 256, and keeps their samples" do
    target = start_target("thread_churn", "640")
    recorder = RubySpy::Recorder.new(target.pid, rate: 1000).start
    # 640 threads of 150 ms each, each sampled many times however slowly the machine runs.
    target.result(".started", timeout: 120)
    profile = recorder.stop
    threads = profile.threads
    expect(threads.size).to be < 600, "#{threads.size} threads"
    expect(threads.count { |t| t[:name] == "ended threads" }).to eq(1)
    ended = threads.index { |t| t[:name] == "ended threads" }
    expect(profile.notes.join).to match(/\d+ threads that ended were merged into "ended threads" \(past 256 threads\)/)
    jobs = profile.stacks.select { |s| s[:frames].any? { |f| f.label.end_with?("Jobs.run") } }
    merged = jobs.select { |s| s[:thread] == ended }
    # Summed: one stack per state and frames, not one per thread.
    expect(merged.map { |s| [s[:state], s[:frames].map(&:to_s)] }.uniq.size).to eq(merged.size)
    expect(merged.sum { |s| s[:samples] }).to be > 1000
    expect(threads[ended][:states].values.sum).to be >= merged.sum { |s| s[:samples] }

    # The Firefox Profiler's own code lists every thread, the merged one by its name.
    next unless RubySpyTest::ProfilerCli.available?

    Dir.mktmpdir do |dir|
      path = profile.write(File.join(dir, "churn.json.gz"), format: :firefox)
      RubySpyTest::ProfilerCli.open(path) do |pq|
        names = pq.threads.values
        expect(names.count("ended threads")).to eq(1)
        expect(names.size).to eq(threads.count { |t| t[:states].values.sum.positive? })
      end
    end
  end
end
