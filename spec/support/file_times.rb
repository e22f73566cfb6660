# frozen_string_literal: true

require "json"

module RubySpyTest
  # The wall time of each spec file's top-level groups, their before(:context) and
  # after(:context) hooks included, which no example's run_time counts (a source gem built in
  # a before(:context) takes a minute). Written as {"file" => seconds} to
  # RUBYSPY_FILE_TIMES when the run ends; script/lib/slowest.rb prints the slowest files.
  class FileTimes
    def initialize(path)
      @path = path
      @seconds = Hash.new(0.0)
      @started = {}
    end

    def example_group_started(notification)
      group = notification.group
      @started[group] = now if group.top_level?
    end

    def example_group_finished(notification)
      started = @started.delete(notification.group)
      @seconds[notification.group.file_path] += now - started if started
    end

    def close(_notification)
      File.write(@path, JSON.generate(@seconds))
    end

    private

    def now
      Process.clock_gettime(Process::CLOCK_MONOTONIC)
    end
  end
end

if (path = ENV["RUBYSPY_FILE_TIMES"])
  RSpec.configure do |config|
    config.reporter.register_listener(RubySpyTest::FileTimes.new(path),
                                      :example_group_started, :example_group_finished, :close)
  end
end
