# frozen_string_literal: true

require "forwardable"
require_relative "test_profiling"

module RubySpy
  # Profiling RSpec runs with rbspy_ext's self-profiling sampler. Install it from
  # spec_helper.rb or the command line:
  #
  #   require "rbspy_ext/rspec"        # or: rspec --require rbspy_ext/rspec
  #
  # It does nothing unless asked: with none of the variables below set and no example marked
  # +:rubyspy+, it adds no hook and does not even load the extension.
  #
  # - +RUBYSPY=1+ records the run of the examples (from the first example to the last) and
  #   writes +tmp/rubyspy/suite.speedscope.json+ and +suite.svg+, plus +suite.raw+, and prints
  #   the slowest functions of the whole run (before(:suite) hooks and every thread
  #   included) at the end. Every sample taken while an example runs carries the
  #   tag +example: <example id>+, so the suite profile can be split afterwards:
  #   +RubySpy::Profile.load("tmp/rubyspy/suite.raw").group_by(:example)+.
  # - +RUBYSPY=boot+ records only the load of the suite (from this require to the first
  #   example) into +tmp/rubyspy/boot.*+.
  # - +it "...", :rubyspy do+ (or +rubyspy: { rate: 999, format: :pprof }+) writes one profile
  #   of that example to +tmp/rubyspy/examples/<example id>.<ext>+; reruns overwrite it. It
  #   has every thread's samples while the example ran (a server thread's too), each tagged
  #   +example: <example id>+. The process keeps its sampler's spy warm between recordings,
  #   so a 10 ms example gets samples of its own code.
  # - +rubyspy: { allocations: true }+ (or a rate in bytes) tracks that example's allocations
  #   instead of its time: +tmp/rubyspy/examples/<example id>.allocs.pb.gz+ (Go's profile) and
  #   +.allocs.txt+. +RUBYSPY_ALLOCATIONS=1+ tracks the whole suite's
  #   (+RUBYSPY_ALLOCATION_RATE+ bytes a sample, default 512 KiB) into +suite.allocs.*+ and
  #   prints the top source lines.
  # - +RUBYSPY_SAMPLE=10+ profiles ten examples picked at random (from RSpec's seed, so
  #   +--seed+ picks the same ones again), as if each were marked +:rubyspy+.
  # - +RUBYSPY_RATE+ (Hz, default 999), +RUBYSPY_FORMAT+ (one or more of
  #   {RubySpy::Profile::FORMATS}, comma-separated) and +RUBYSPY_DIR+ (default tmp/rubyspy)
  #   override the defaults.
  #
  # A problem of the integration itself (an unwritable directory, an unknown format) prints
  # one warning and never fails an example or hides its result.
  #
  # The matcher {Matchers#spend_at_most} is available in every example group.
  module RSpec
    TAG = TestProfiling::TAG

    class << self
      extend Forwardable
      # The shared settings and helpers (see {RubySpy::TestProfiling}).
      def_delegators :"RubySpy::TestProfiling", :valid_rate?, :max_rate, :settings, :warn_once, :formats,
                     :load_core

      # Installs the hooks the settings call for into +config+ (done on require).
      # @param config [RSpec::Core::Configuration]
      # @param settings [TestProfiling::Settings]
      # @return [void]
      def install(config, settings = self.settings)
        config.include(Matchers)
        # Where the gem was installed without native code, the suite runs as if the
        # integration were absent, and the matcher skips its examples.
        if (reason = RubySpy::Native.unsupported_reason)
          return warn_once("not profiling: rbspy_ext cannot read processes on #{RUBY_PLATFORM} (#{reason})")
        end

        run = Run.new(settings, config)
        run.start_boot if settings.mode == :boot
        config.before(:suite) { run.before_suite }
        config.after(:suite) { run.after_suite }
        config.around(:example, :rubyspy) { |example| run.profile_example(example) }
        return unless settings.mode == :suite || settings.sample.positive?

        config.around(:example) { |example| run.around_example(example) }
      end
    end

    # One run of the suite, as RSpec's hooks see it (see {TestProfiling::Session}).
    # @api private
    class Run
      def initialize(settings, config)
        @config = config
        @session = TestProfiling::Session.new(settings, -> { config.output_stream || $stdout }, noun: "example")
      end

      def start_boot
        @session.start_boot
      end

      def before_suite
        @session.pick(all_example_ids, @config.seed)
        @session.start_suite
      end

      def after_suite
        @session.end_suite
      end

      # Every example, when the suite is recorded or examples are sampled.
      def around_example(example)
        if @session.sampled?(example.id) && !example.metadata[:rubyspy]
          profile_example(example)
        else
          @session.tagged(example.id) { example.run }
        end
      end

      # One profile of one example (marked +:rubyspy+, or sampled).
      def profile_example(example)
        options = example.metadata[:rubyspy]
        options = {} unless options.is_a?(Hash)
        @session.profile_one(example.id, options, "the :rubyspy metadata of #{example.id}") { example.run }
      end

      private

      def all_example_ids
        ::RSpec.world.ordered_example_groups.flat_map do |group|
          group.descendants.flat_map { |g| ::RSpec.world.filtered_examples[g] }
        end.map(&:id)
      end
    end

    # Sampling-based performance expectations, included in every example group.
    module Matchers
      # Passes when at most +percent+ of the samples taken while the block runs have the
      # given function on the stack:
      #
      #   expect { parse_all }.to spend_at_most(10).percent_in("JSON.parse")
      #
      # The block runs once, sampled at 9999 Hz (+.at_rate(hz)+ changes it). A share measured
      # from n samples is uncertain by about 1.96 * sqrt(p * (1 - p) / n) either way (95%): with
      # 100 samples and a true share of 10%, anything from 4% to 16% can come out. So the
      # matcher refuses to judge on fewer than 100 samples (+.with_minimum_samples(n)+) and fails
      # instead; keep the bound well away from the share you expect, or make the block longer.
      # @param percent [Numeric] the most the share may be, in percent (0-100)
      # @return [SpendAtMost]
      def spend_at_most(percent)
        SpendAtMost.new(percent)
      end
    end

    # The matcher behind {Matchers#spend_at_most}.
    class SpendAtMost
      DEFAULT_RATE = 9_999
      DEFAULT_MINIMUM = 100

      # @param percent [Numeric]
      def initialize(percent)
        unless percent.is_a?(Numeric) && percent >= 0 && percent <= 100
          raise ArgumentError, "spend_at_most takes a percentage between 0 and 100, got #{percent.inspect}"
        end

        @percent = percent
        @rate = DEFAULT_RATE
        @minimum = DEFAULT_MINIMUM
        @function = nil
      end

      # @param function [String, Regexp] see {RubySpy::Profile#share}
      # @return [self]
      def percent_in(function)
        unless function.is_a?(String) || function.is_a?(Regexp)
          raise TypeError, "percent_in takes a function label (String) or a Regexp, got #{function.class}"
        end

        @function = function
        self
      end

      # @param hz [Numeric] the sampling rate while the block runs
      # @return [self]
      def at_rate(hz)
        unless RubySpy::RSpec.valid_rate?(hz)
          raise ArgumentError, "at_rate takes a rate in Hz between 0 and #{RubySpy::RSpec.max_rate}, got #{hz.inspect}"
        end

        @rate = hz
        self
      end

      # @param count [Integer] the fewest samples the matcher judges on
      # @return [self]
      def with_minimum_samples(count)
        raise ArgumentError, "with_minimum_samples takes a positive Integer, got #{count.inspect}" unless
          count.is_a?(Integer) && count.positive?

        @minimum = count
        self
      end

      # @return [Boolean] true: the matcher takes a block
      def supports_block_expectations?
        true
      end

      # @return [Boolean] false: the matcher needs a block
      def supports_value_expectations?
        false
      end

      # @param block [Proc] the work to measure
      # @return [Boolean]
      def matches?(block)
        measure(block)
        enough? && @share * 100 <= @percent
      end

      # @param block [Proc]
      # @return [Boolean]
      def does_not_match?(block)
        measure(block)
        enough? && @share * 100 > @percent
      end

      # @return [String]
      def failure_message
        return too_few unless enough?

        format("expected at most %<want>g%% of samples in %<fn>s, got %<got>.1f%% %<detail>s",
               want: @percent, fn: @function.inspect, got: @share * 100, detail: detail)
      end

      # @return [String]
      def failure_message_when_negated
        return too_few unless enough?

        format("expected more than %<want>g%% of samples in %<fn>s, got %<got>.1f%% %<detail>s",
               want: @percent, fn: @function.inspect, got: @share * 100, detail: detail)
      end

      # @return [String]
      def description
        "spend at most #{@percent}% in #{@function.inspect}"
      end

      private

      def measure(block)
        raise ArgumentError, "spend_at_most(...) needs .percent_in(function)" unless @function
        raise ArgumentError, "spend_at_most needs a block: expect { ... }.to spend_at_most(...)" unless block.is_a?(Proc)

        if (reason = RubySpy::Native.unsupported_reason)
          # What `skip` does inside an example: mark it, then end it.
          message = "spend_at_most cannot measure on #{RUBY_PLATFORM}: #{reason}"
          ::RSpec::Core::Pending.mark_skipped!(::RSpec.current_example, message)
          raise ::RSpec::Core::Pending::SkipDeclaredInExample, message
        end

        RSpec.load_core
        key = "matcher-#{object_id}-#{Process.clock_gettime(Process::CLOCK_MONOTONIC, :nanosecond)}"
        recorder = RubySpy::Recorder.new(Process.pid, rate: @rate).start
        begin
          RubySpy.tag(rubyspy_matcher: key) { block.call }
        ensure
          profile = recorder.stop.select(rubyspy_matcher: key)
        end
        @samples = profile.samples
        @share = profile.share(@function)
      end

      def enough?
        @samples >= @minimum
      end

      def too_few
        format("only %<n>d samples of the block at %<hz>g Hz, fewer than the %<min>d needed to judge a share: " \
               "make the block run longer (%<min>d samples take about %<ms>.0f ms), raise .at_rate(hz), " \
               "or lower .with_minimum_samples(n)", n: @samples, hz: @rate, min: @minimum,
                                                   ms: 1000.0 * @minimum / @rate)
      end

      def detail
        margin = 196 * Math.sqrt(@share * (1 - @share) / @samples)
        format("(%<hits>d of %<n>d samples; +/- %<m>.1f points at 95%%)",
               hits: (@share * @samples).round, n: @samples, m: margin)
      end
    end
  end
end

RubySpy::RSpec.install(RSpec.configuration) if defined?(RSpec) && RSpec.respond_to?(:configuration)
