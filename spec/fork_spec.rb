# frozen_string_literal: true

require "spec_helper"
require "rbspy_ext"
require "timeout"

# Preforking servers (Puma, Unicorn, Passenger) fork after boot: tags and the published
# ruby_profiler_state must be right in each child, which reads as its own process.
RSpec.describe "fork" do
  it "gives the child its own published table: each process's samples carry its own tags" do
    target = start_target("tagged_fork")
    child = target.info["child"]
    expect(child).to be_a(Integer).and(satisfy { |pid| pid != target.pid })
    expect(target.info["child_tags"]).to eq("side" => "child", "origin" => target.pid.to_s)
    begin
      tags_of = lambda do |pid|
        RubySpy.record(pid, rate: 499, duration: 0.5).tags.map { |set| set[:tags] }.reject(&:empty?).uniq
      end
      expect(tags_of.(target.pid)).to eq([{ side: "parent", origin: target.pid.to_s }])
      expect(tags_of.(child)).to eq([{ side: "child", origin: target.pid.to_s }])
    ensure
      Process.kill(:KILL, child) rescue nil
    end
  end

  it "never hangs a child that forked while tagged threads were ending (the published-table lock)" do
    stop = false
    churn = Array.new(2) do
      Thread.new do
        until stop
          Thread.new { RubySpy.tag(churn: 1) { Thread.pass } }.join
        end
      end
    end
    hung = []
    40.times do
      pid = fork do
        # Tagging in the child takes the lock a thread of the parent may have held at fork.
        RubySpy.tag(child: 1) { Thread.new { RubySpy.tag(inner: 1) { 1 } }.join }
        GC.start
        exit!(0)
      end
      status = begin
        Timeout.timeout(10) { Process.wait2(pid)[1] }
      rescue Timeout::Error
        Process.kill(:KILL, pid)
        Process.wait(pid)
        hung << pid
        nil
      end
      expect(status&.success?).to be(true) unless hung.include?(pid)
    end
    expect(hung).to eq([])
  ensure
    stop = true
    churn&.each(&:join)
  end
end
