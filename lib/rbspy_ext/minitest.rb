# frozen_string_literal: true

require "minitest"
require_relative "test_profiling"

module RubySpy
  # Profiling Minitest runs with rbspy_ext's self-profiling sampler, with the environment
  # variables of the RSpec integration. Install it from test_helper.rb:
  #
  #   require "minitest/autorun"
  #   require "rbspy_ext/minitest"
  #
  # It does nothing unless asked: with none of the variables set it adds no hook and does
  # not load the extension.
  #
  # - +RUBYSPY=1+ records the run of the tests into +tmp/rubyspy/suite.speedscope.json+,
  #   +suite.svg+ and +suite.raw+, and prints the top functions after Minitest's report.
  #   Every sample taken while a test runs carries the tag +example: "Class#test_name"+.
  # - +RUBYSPY=boot+ records only the load of the suite into +tmp/rubyspy/boot.*+.
  # - +RUBYSPY_SAMPLE=10+ profiles ten tests picked from Minitest's seed (+--seed+ picks the
  #   same ones again), each into +tmp/rubyspy/examples/<Class-test_name>.<ext>+.
  # - +RUBYSPY_ALLOCATIONS=1+ tracks the run's allocations into +tmp/rubyspy/suite.allocs.*+ and
  #   prints the source lines that allocated most, as for RSpec.
  # - +RUBYSPY_RATE+, +RUBYSPY_FORMAT+ and +RUBYSPY_DIR+ as for RSpec.
  # - Parallel workers write their own suite files: +suite.<TEST_ENV_NUMBER>.*+ under
  #   parallel_tests (+suite.1.*+ for its first process), +suite.<worker>.*+ in each process
  #   Rails' +parallelize+ forks.
  module Minitest
    class << self
      # The session of this process (a parallel worker's own, in a worker), when profiling.
      # @return [TestProfiling::Session, nil]
      attr_reader :session

      # Installs the plugin the settings call for (done on require).
      # @param settings [TestProfiling::Settings]
      # @return [void]
      def install(settings = TestProfiling.settings)
        return unless settings.mode != :off || settings.sample.positive? || settings.allocations
        if (reason = RubySpy::Native.unsupported_reason)
          return TestProfiling.warn_once("not profiling: rbspy_ext cannot read processes on #{RUBY_PLATFORM} " \
                                         "(#{reason})")
        end

        @settings = settings
        @session = TestProfiling::Session.new(settings, -> { $stdout }, worker: parallel_tests_worker)
        @session.start_boot
        ::Minitest::Test.prepend(TestHooks)
        # Not a name in Minitest.extensions: a non-empty list before Minitest.run would keep
        # load_plugins (minitest <= 5.20) from loading any other plugin, Rails' among them.
        ::Minitest.singleton_class.prepend(RunHook)
      end

      # Called once the run's options are known and every plugin has set up (see
      # RunHook): picks the sampled tests, starts the suite's recording, adds the reporter
      # that ends it, and follows Rails' parallel workers.
      # @api private
      def start(options)
        @session.pick(test_ids, options[:seed])
        @session.start_suite
        ::Minitest.reporter << Reporter.new(@session)
        follow_rails_workers
      end

      private

      # parallel_tests numbers its processes with TEST_ENV_NUMBER: "" for the first, then
      # "2", "3"...
      def parallel_tests_worker
        return nil unless ENV.key?("TEST_ENV_NUMBER")

        ENV["TEST_ENV_NUMBER"].empty? ? "1" : ENV["TEST_ENV_NUMBER"]
      end

      def test_ids
        ::Minitest::Runnable.runnables.flat_map do |klass|
          klass.runnable_methods.map { |m| "#{klass.name}##{m}" }
        end
      end

      # Rails forks its workers after the plugins start: each gets a session of its own,
      # ended by Rails' cleanup hook as the worker finishes.
      def follow_rails_workers
        return unless defined?(ActiveSupport::Testing::Parallelization)

        ActiveSupport::Testing::Parallelization.after_fork_hook do |worker|
          # Under parallel_tests too, each process's workers get names of their own.
          name = [parallel_tests_worker, worker].compact.join(".")
          @session = @session.for_worker(name)
          @session.start_suite
        end
        ActiveSupport::Testing::Parallelization.run_cleanup_hook { |_worker| @session.end_suite }
      end
    end

    # Prepended to Minitest's singleton: starts profiling after Minitest.init_plugins, which
    # every run calls (with or without --no-plugins), once the reporter exists.
    module RunHook
      # @api private
      def init_plugins(options)
        super
        RubySpy::Minitest.start(options)
      end
    end

    # Prepended to Minitest::Test: each test runs under the tag of its name while the
    # suite is recorded, or under a recording of its own when RUBYSPY_SAMPLE picked it.
    module TestHooks
      # @return [Minitest::Result, Minitest::Test] what Minitest::Test#run returns
      def run
        session = RubySpy::Minitest.session
        return super unless session

        id = "#{self.class.name}##{name}"
        if session.sampled?(id)
          session.profile_one(id, {}, "RUBYSPY_SAMPLE") { super }
        else
          session.tagged(id) { super }
        end
      end
    end

    # Ends the suite's recording when Minitest reports, after its own summary.
    # @api private
    class Reporter < ::Minitest::AbstractReporter
      def initialize(session)
        super()
        @session = session
      end

      def report
        @session.end_suite
      end
    end
  end
end

RubySpy::Minitest.install
