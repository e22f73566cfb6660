# frozen_string_literal: true

# Specs run with `rspec` from the repository root and test the gem in lib/ (the compiled
# extension lands in lib/rbspy_ext/ via `rake compile`). Spec files require "rbspy_ext"
# themselves, so that loading this helper never needs the extension.
lib = File.expand_path("../lib", __dir__)
$LOAD_PATH.unshift(lib) unless $LOAD_PATH.include?(lib)

# spec/support/: paths.rb, proc_stat.rb (/proc/PID/stat), target_ruby.rb (which Ruby the
# fixtures run on), binary_ruby.rb (fixtures run by one ruby executable), target.rb (a
# started fixture), helpers/ (what examples call: targets,
# waiting, the CLI, child processes), and one file per area (frames, recording, servers...).
Dir[File.join(__dir__, "support", "**", "*.rb")].sort.each { |f| require f }

RSpec.configure do |config|
  config.include RubySpyTest::TargetHelpers
  config.include RubySpyTest::Waiting
  config.include RubySpyTest::CLIHelpers
  config.include RubySpyTest::ProcessHelpers
  config.include RubySpyTest::ServerHelpers
  config.after { stop_all_targets }
  config.after { stop_servers }

  config.expect_with :rspec do |expectations|
    # Show whole frame lists in failure messages.
    if expectations.respond_to?(:max_formatted_output_length=)
      expectations.max_formatted_output_length = nil
    end
  end
  # Examples whose figures depend on how busy the machine is carry `quiet: true`; script/test
  # runs them on each Ruby of the matrix with nothing beside them (only), and the rest of
  # their files two at a time (skip).
  case ENV["RUBYSPY_QUIET_EXAMPLES"]
  when "only" then config.filter_run_including quiet: true
  when "skip" then config.filter_run_excluding quiet: true
  end
  config.order = :random
  Kernel.srand config.seed
end
