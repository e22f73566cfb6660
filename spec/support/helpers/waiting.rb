# frozen_string_literal: true

require "etc"

module RubySpyTest
  # Waiting until a process is in a state, rather than sleeping for a time that a busy
  # machine may not be able to keep to. Included into every example group (spec_helper.rb)
  # and into the support classes that wait; RubySpyTest::Waiting.wait_for from a module.
  module Waiting
    module_function

    # Calls the block every +interval+ seconds until it returns something truthy, and returns
    # that. After +timeout+ seconds raises, naming +what+ was waited for ("the recording to
    # end") and adding +detail+ (called then: what was seen last, a log); with
    # raise_on_timeout: false returns nil instead, for a caller that has more to do first
    # (stop what it started) or that only bounds a wait its own assertions then judge. The
    # block may raise itself, say for a process that exited rather than got ready.
    def wait_for(what, timeout: 10, interval: 0.01, detail: nil, raise_on_timeout: true)
      deadline = Process.clock_gettime(Process::CLOCK_MONOTONIC) + timeout
      loop do
        value = yield
        return value if value

        if Process.clock_gettime(Process::CLOCK_MONOTONIC) > deadline
          return nil unless raise_on_timeout

          message = "#{what}: not within #{timeout.round(2)} s"
          raise detail ? "#{message}\n#{detail.call}" : message
        end
        sleep interval
      end
    end

    # How long process +pid+ has run, from /proc (start time in clock ticks, system uptime):
    # what attach.rs measures before it calls a layout that does not fit the wrong one.
    def process_age(pid)
      ticks = File.read("/proc/#{pid}/stat").split(")").last.split[19].to_f
      File.read("/proc/uptime").split.first.to_f - ticks / Etc.sysconf(Etc::SC_CLK_TCK)
    end
  end
end
