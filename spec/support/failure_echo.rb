# frozen_string_literal: true

module RubySpyTest
  # Names each failure on stderr the moment it happens. CI shows only a part of a long
  # run's output, and RSpec lists its failures at the very end, after the pending list:
  # the line printed here lands next to the failure's F, inside whatever part is shown.
  class FailureEcho
    def example_failed(notification)
      example = notification.example
      message = example.execution_result.exception&.message.to_s.strip.lines.first(4).join
      $stderr.puts "\nFAILED #{example.location} #{example.full_description}\n  #{message}"
    end
  end
end

RSpec.configure do |config|
  # Registered once the run starts, so that the formatters chosen on the command line
  # (or progress, by default) are set up first; adding a formatter here would replace them.
  config.before(:suite) do
    config.reporter.register_listener(RubySpyTest::FailureEcho.new, :example_failed)
  end
end
