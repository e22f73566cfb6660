# frozen_string_literal: true

require "open3"

module RubySpyTest
  # Child processes an example runs beside its targets (included into every example group,
  # see spec_helper.rb).
  module ProcessHelpers
    # Open3.popen3 (+kind+ :popen2 or :popen2e for those), except that a child still running
    # when the block ends is killed first. Open3 closes the pipes and then waits for the
    # child: after an expectation failed in the block, before the child was told to stop, a
    # `rubyspy record` that runs until SIGINT would be waited for forever.
    def popen_killed_after(*cmd, kind: :popen3, **opts)
      Open3.public_send(kind, *cmd, **opts) do |*ios|
        yield(*ios)
      ensure
        begin
          Process.kill(:KILL, ios.last.pid) if ios.last.alive?
        rescue Errno::ESRCH
          nil # exited meanwhile
        end
      end
    end

    # The exit status of the child +wait+ (Open3's waiter thread) once it exits; after
    # +timeout+ seconds, what it is waiting on, then it is killed and the example fails.
    def exit_status(wait, what, timeout: 60)
      return wait.value if wait.join(timeout)

      state = RubySpyTest::HangGuard.describe_process(wait.pid)
      begin
        Process.kill(:KILL, wait.pid)
      rescue Errno::ESRCH
        nil # it exited just now
      end
      raise "#{what}: did not exit within #{timeout} s\n#{state.join("\n")}"
    end

    # Whether process +pid+ is recording: a recorder's sampler thread ("rbspy_ext sampler",
    # which comm cuts to 15 bytes) runs in it.
    def sampler_thread?(pid)
      Dir.glob("/proc/#{pid}/task/*/comm").any? do |path|
        File.read(path).chomp == "rbspy_ext sampl"
      rescue SystemCallError
        false
      end
    end
  end
end
