# frozen_string_literal: true

require_relative "spec_helper"
require "rbspy_ext"
require "open3"

# A reader no one here wrote: bpftrace, following only the documented procedure
# (docs/profiler-state.md, the script docs/profiler-state.bt), prints the tags of a tagged
# Ruby process. Runs when bpftrace and BPF are usable here; says why when they are not.
RSpec.describe "ruby_profiler_state read by bpftrace" do
  include RubySpyTest::Recording

  def script = File.join(RubySpyTest::ROOT, "docs", "profiler-state.bt")

  # Why BPF cannot be used here, or nil.
  def bpf_unusable
    return "the extension is built for the host Ruby only" unless RubySpyTest::TargetRuby.current.host?
    return "needs root (bpftrace loads BPF programs)" unless Process.uid.zero?

    bpftrace = ENV.fetch("PATH", "").split(":").map { |d| File.join(d, "bpftrace") }.find { |f| File.executable?(f) }
    return "bpftrace is not installed (script/setup installs it)" unless bpftrace

    tracing = "/sys/kernel/tracing"
    unless File.exist?(File.join(tracing, "available_events")) ||
           system("mount", "-t", "tracefs", "nodev", tracing, out: File::NULL, err: File::NULL)
      return "tracefs is not mounted and cannot be mounted at #{tracing}"
    end
    nil
  end

  it "prints the tag values of the current fiber, found through the published offset" do
    reason = bpf_unusable
    skip reason if reason

    target = start_target("tagged_sleeper")
    offset = RubySpy.attach(target.pid).profiler_state_offset
    expect(offset).to be_a(Integer)
    libc = File.readlines("/proc/#{target.pid}/maps").map { |l| l.split[5] }
                .find { |p| p&.match?(%r{/libc\.so\.6\z}) } or raise "no libc mapped"
    out, status = Open3.capture2e("timeout", "60", "bpftrace", script, libc, target.pid.to_s, "--", offset.to_s)
    skip "bpftrace could not attach here: #{out.lines.last(3).join.strip}" if out.include?("ERROR: ") && !out.include?("table ")
    expect(status.exitstatus).to eq(0), out
    table = out[/table \h+ size (\d+) capacity (\d+)/] or raise "no table printed:\n#{out}"
    size, capacity = table.scan(/\d+/).last(2).map(&:to_i)
    expect(size).to eq(2)
    expect(capacity).to be >= 2
    expect(capacity & (capacity - 1)).to eq(0) # a power of two
    integers = out.scan(/integer (-?\d+)/).flatten.map(&:to_i)
    expect(integers).to contain_exactly(4242, 7)
    expect(target.info["tags"]).to eq("request_num" => 4242, "user" => 7)
  end
end
