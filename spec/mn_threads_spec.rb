# frozen_string_literal: true

require_relative "spec_helper"
require "rbspy_ext"

# Ruby 3.3's M:N threads (RUBY_MN_THREADS=1) run several Ruby threads on one native thread,
# switching between them with no fiber switch, so the native thread's ruby_profiler_state
# must be re-synced each time a Ruby thread resumes. The targets load rbspy_ext themselves:
# these run in the script/rubies matrix on 3.3 and 3.4, with the extension built for each
# (script/rubies ext), and are skipped on the host's 3.1, which has no M:N threads.
RSpec.describe "tags under M:N threads" do
  include RubySpyTest::Recording

  # Two native threads: the main thread's own, and one the six workers take turns on.
  let(:mn_env) { { "RUBY_MN_THREADS" => "1", "RUBY_MAX_CPU" => "2" } }

  before do
    ruby = RubySpyTest::TargetRuby.current
    skip "M:N threads need Ruby 3.3+ (target: #{ruby}, #{ruby.version})" if ruby.version < Gem::Version.new("3.3")
    skip "no rbspy_ext built for #{ruby}: run script/rubies ext #{ruby.name}" unless ruby.extension?
  end

  # Every worker's samples carry its own `worker:` tag only, and more than +at_least+ of them.
  def expect_own_tags(profile, at_least:)
    groups = profile.group_by(:worker)
    expect(groups.keys.compact.sort).to eq((0...6).map(&:to_s))
    groups.each do |value, group|
      next if value.nil?

      sampled = group.threads.reject { |t| t[:states].values.sum.zero? }.map { |t| t[:name] }.uniq
      expect(sampled).to eq(["worker-#{value}"]), "samples tagged worker: #{value} came from #{sampled}"
      expect(group.samples).to be > at_least
    end
  end

  it "keeps each worker's own table published while six workers share one native thread" do
    info = start_target("mn_tags_check", env: mn_env).info
    expect(info["resyncs_on_resume"]).to be(true)
    expect(info["native_threads"]).to be < info["workers"], "the workers did not share native threads: #{info}"
    expect(info["checks"]).to all(be > 50)
    expect(info["mismatches"]).to eq([0] * info["workers"]), info.to_s
  end

  it "tags each worker's samples with its own tag only, read from outside while they take turns" do
    target = start_target("mn_tagged_workers", env: mn_env)
    expect(target.info["native_threads"]).to be < target.info["workers"]
    profile = RubySpy::Recorder.new(target.pid, rate: 2000, duration: 2).start.wait.stop
    expect_own_tags(profile, at_least: 100)
  end

  # In the kernel, a tick lands on the shared native thread, and which worker runs there is
  # told by Ruby's own ruby_current_ec thread-local: each worker stays one thread with its
  # own tag, under any positive RUBY_MN_THREADS (Ruby turns M:N on for atoi(...) > 0).
  %w[1 2].each do |mn|
    it "tags each worker's samples with its own tag in the kernel too (RUBY_MN_THREADS=#{mn})" do
      skip "loading BPF programs needs root (CAP_BPF and CAP_PERFMON)" unless Process.uid.zero?

      target = start_target("mn_tagged_workers", env: mn_env.merge("RUBY_MN_THREADS" => mn))
      expect(target.info["native_threads"]).to be < target.info["workers"]
      profile = record_until_samples(target.pid, samples: 600, mode: :bpf, rate: 999)
      expect(profile.notes.join).to include("ruby_current_ec")
      expect(profile.cost).to include(:bpf_runs)
      workers = profile.threads.select { |t| t[:name].to_s.start_with?("worker-") }
      expect(workers.map { |t| t[:name] }.sort).to eq((0...6).map { |i| "worker-#{i}" }),
                                                     profile.threads.map { |t| [t[:tid], t[:name]] }.inspect
      expect_own_tags(profile, at_least: 20)
    end
  end
end
