# frozen_string_literal: true

require_relative "spec_helper"
require "rbspy_ext"

# What a recording and a handle do when the process behind a pid changes under them: it is
# killed, runs exec, or exits and its pid goes to another process. They keep what they have,
# say what happened, and never read the new process's memory as the old one's.
RSpec.describe "target lifecycle" do
  include RubySpyTest::Recording

  before do
    skip "the fixtures exec host programs" unless RubySpyTest::TargetRuby.current.host?
  end

  def record_until_done(pid, timeout: 10)
    recorder = RubySpy::Recorder.new(pid, rate: 500).start # no duration: until the target ends
    wait_for("the recording to end", timeout: timeout) { !recorder.running? }
    recorder.stop
  end

  it "killed with SIGKILL mid-recording: the recording ends by itself, keeps its samples and says the process exited" do
    target = start_target("exits_soon", "30")
    recorder = RubySpy::Recorder.new(target.pid, rate: 500).start
    wait_for("50 samples before the kill") { recorder.progress[:samples] > 50 }
    target.kill!
    # Stopped either way: what the profile says is the test.
    wait_for("the recording to end", timeout: 5, raise_on_timeout: false) { !recorder.running? }
    profile = recorder.stop
    expect(profile.samples).to be > 50
    expect(profile.notes.join("\n")).to match(/process #{target.pid} exited after/)
    expect(profile.render(:collapsed)).to match(method_label_pattern("Burner", "burn", target.ruby_version))
  end

  it "execs a program that is not Ruby mid-recording: the recording ends and names the exec and the new program" do
    target = start_target("execs_later", "sleep", "0.5")
    profile = record_until_done(target.pid)
    expect(profile.notes.join("\n")).to match(%r{process #{target.pid} ran exec and now runs \S*/sleep after})
    expect(profile.render(:collapsed)).to match(method_label_pattern("BeforeExec", "spin", target.ruby_version))
  end

  it "execs a fresh Ruby mid-recording: no sample holds the new program's frames, and the exec is reported" do
    target = start_target("execs_later", "ruby", "0.5")
    profile = record_until_done(target.pid)
    expect(profile.notes.join("\n")).to match(/process #{target.pid} ran exec and now runs \S*ruby\S* after/)
    collapsed = profile.render(:collapsed)
    expect(collapsed).to match(method_label_pattern("BeforeExec", "spin", target.ruby_version))
    expect(collapsed).not_to include("AfterExec")
    expect(profile.duration).to be < 3
  end

  it "a handle whose process ran exec raises ProcessReplaced (a ProcessExited) naming the new program" do
    target = start_target("execs_later", "ruby", "0.3")
    handle = RubySpy.attach(target.pid)
    expect(handle.snapshot.map(&:label)).to include(a_string_matching(/spin/))
    # Past the exec: the process's command line is the fresh Ruby's.
    wait_for("the exec") { File.read("/proc/#{target.pid}/cmdline").include?("AfterExec") }
    expect { handle.snapshot }.to raise_error(RubySpy::ProcessReplaced, /#{target.pid}.*ran exec and now runs \S*ruby/)
    expect(RubySpy::ProcessReplaced.ancestors).to include(RubySpy::ProcessExited)
    # Attaching again reads the new program, once it has started (before, attaching says it
    # is not Ruby yet) and runs AfterExec.spin.
    labels = wait_for("the fresh Ruby in AfterExec.spin") do
      RubySpy.attach(target.pid).snapshot.map(&:label).join(" ").then { |l| l if l.include?("AfterExec") }
    rescue RubySpy::NotRubyProcess
      nil
    end
    expect(labels).to include("AfterExec")
  end

  it "a handle whose pid was reused by another process raises ProcessReplaced, not that process's stack" do
    skip "setting the next pid needs root (/proc/sys/kernel/ns_last_pid)" unless Process.uid.zero?

    target = start_target("nested_methods")
    pid = target.pid
    handle = RubySpy.attach(pid)
    handle.snapshot
    target.stop
    # The kernel gives the next process ns_last_pid + 1 (what CRIU does to restore a pid);
    # another process may take it first on a busy machine, so try a few times.
    successor = nil
    5.times do
      File.write("/proc/sys/kernel/ns_last_pid", (pid - 1).to_s)
      candidate = Process.spawn(RbConfig.ruby, "-e", "def reused_pid_spin = loop {}; reused_pid_spin")
      if candidate == pid
        successor = candidate
        break
      end
      Process.kill(:KILL, candidate)
      Process.wait(candidate)
    end
    skip "could not get pid #{pid} again (another process took it)" unless successor
    begin
      # The new Ruby is up once it runs its method (before, it may not read as Ruby yet).
      wait_for("the new Ruby in reused_pid_spin") do
        RubySpy.snapshot(successor).any? { |f| f.label.end_with?("reused_pid_spin") } || nil
      rescue RubySpy::Error
        nil
      end
      expect { handle.snapshot }.to raise_error(RubySpy::ProcessReplaced, /its pid now belongs to another process/)
    ensure
      Process.kill(:KILL, successor)
      Process.wait(successor)
    end
  end
end
