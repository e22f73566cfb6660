# frozen_string_literal: true

require "fileutils"
# Plain Ruby (no extension): the format names and the error classes.
require_relative "error"
require_relative "native"
require_relative "profile"

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
    DEFAULT_RATE = 999
    DEFAULT_DIR = "tmp/rubyspy"
    SUITE_FORMATS = %i[speedscope flamegraph].freeze
    EXAMPLE_FORMATS = %i[speedscope].freeze
    # The tag each example's samples carry.
    TAG = :example
    # How many functions the end-of-run summary lists.
    SUMMARY_FUNCTIONS = 10

    # What the environment asked for.
    # @!attribute mode [Symbol] +:off+, +:suite+ or +:boot+
    # @!attribute rate [Numeric, nil] RUBYSPY_RATE, when valid
    # @!attribute formats [Array<Symbol>, nil] RUBYSPY_FORMAT, when valid
    # @!attribute dir [String]
    # @!attribute sample [Integer] how many random examples to profile (0: none)
    Settings = Struct.new(:mode, :rate, :formats, :dir, :sample, keyword_init: true)

    class << self
      # Whether +value+ is a sampling rate a recording takes ({RubySpy.valid_rate?}). The
      # limit is the extension's, so this loads it: a rate is only checked when one is given,
      # which means something is to be recorded.
      # @param value [Object]
      # @return [Boolean]
      def valid_rate?(value)
        load_core
        RubySpy.valid_rate?(value)
      end

      # The highest rate, as whole Hz for messages.
      # @return [Integer, Float]
      def max_rate
        load_core
        RubySpy::MAX_RATE.finite? ? RubySpy::MAX_RATE.to_i : RubySpy::MAX_RATE
      end

      # Reads the settings from +env+; every value that cannot be used is reported with
      # {warn_once} and replaced by its default.
      # @param env [Hash{String => String}]
      # @return [Settings]
      def settings(env = ENV)
        Settings.new(mode: mode(env["RUBYSPY"]), rate: rate(env["RUBYSPY_RATE"]),
                     formats: formats(env["RUBYSPY_FORMAT"], "RUBYSPY_FORMAT"),
                     dir: env["RUBYSPY_DIR"].to_s.empty? ? DEFAULT_DIR : env["RUBYSPY_DIR"],
                     sample: sample(env["RUBYSPY_SAMPLE"]))
      end

      # Prints +message+ once per run on standard error, prefixed with "rubyspy:".
      # @param message [String]
      # @return [void]
      def warn_once(message)
        @warned ||= {}
        return if @warned[message]

        @warned[message] = true
        Kernel.warn("rubyspy: #{message}")
      end

      # Installs the hooks the settings call for into +config+ (done on require).
      # @param config [RSpec::Core::Configuration]
      # @param settings [Settings]
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

      # The file name an example's profile gets: its id (+./spec/a_spec.rb[1:2]+) made safe
      # for a file name (+spec-a_spec.rb-1-2+), stable across runs.
      # @param example [RSpec::Core::Example]
      # @return [String]
      def file_name(example)
        example.id.delete_prefix("./").gsub(/[^A-Za-z0-9_.-]+/, "-").gsub(/\A-+|-+\z/, "")
      end

      # Checks a list of format names (from the environment or metadata).
      # @return [Array<Symbol>, nil] nil when +value+ is nil or names an unknown format
      def formats(value, source)
        return nil if value.nil? || value.to_s.strip.empty?

        names = Array(value).flat_map { |v| v.to_s.split(",") }.map { |v| v.strip.to_sym }
        known = RubySpy::Profile::FORMATS
        unknown = names - known
        return names.uniq if unknown.empty?

        warn_once("unknown format #{unknown.map(&:to_s).join(", ")} in #{source} " \
                  "(known: #{known.join(", ")}); using the default")
        nil
      end

      # Loads the extension itself: only once something is to be recorded.
      # @return [void]
      def load_core
        require_relative "../rbspy_ext"
      end

      private

      def mode(value)
        case value.to_s.strip.downcase
        when "", "0", "false", "no", "off" then :off
        when "boot" then :boot
        when "1", "true", "yes", "on", "suite" then :suite
        else
          warn_once("RUBYSPY=#{value} is not understood (use 1 for the suite or boot for its load); " \
                    "not profiling")
          :off
        end
      end

      def rate(value)
        return nil if value.nil? || value.strip.empty?

        rate = Float(value, exception: false)
        return rate if RubySpy::RSpec.valid_rate?(rate)

        warn_once("RUBYSPY_RATE=#{value} is not a rate in Hz between 0 and #{RubySpy::RSpec.max_rate}; " \
                  "using #{DEFAULT_RATE}")
        nil
      end

      def sample(value)
        return 0 if value.nil? || value.strip.empty?

        n = Integer(value, exception: false)
        return n if n && n >= 0

        warn_once("RUBYSPY_SAMPLE=#{value} is not a number of examples; sampling none")
        0
      end
    end

    # One run of the suite: the recorders it keeps and the files it wrote.
    # @api private
    class Run
      def initialize(settings, config)
        @settings = settings
        @config = config
        @sampled = nil
        @written = []
      end

      def start_boot
        @boot = start_recorder(rate)
      end

      def before_suite
        finish(@boot, "boot", "the load of the suite") if @boot
        @boot = nil
        @sampled = pick_examples if @settings.sample.positive?
        @suite = start_recorder(rate) if @settings.mode == :suite
      end

      def after_suite
        finish(@suite, "suite", "the suite") if @suite
        @suite = nil
        return if @written.empty?

        out.puts "rubyspy: #{@written.size} example profile#{"s" unless @written.size == 1} in " \
                 "#{File.join(@settings.dir, "examples")}/"
      end

      # Every example, when the suite is recorded or examples are sampled.
      def around_example(example)
        if @sampled&.include?(example.id) && !example.metadata[:rubyspy]
          profile_example(example)
        elsif @suite
          RubySpy.tag(TAG => example.id) { example.run }
        else
          example.run
        end
      end

      # One profile of one example (marked +:rubyspy+, or sampled).
      def profile_example(example)
        options = example.metadata[:rubyspy]
        options = {} unless options.is_a?(Hash)
        recorder = start_recorder(example_rate(options))
        return example.run unless recorder

        begin
          RubySpy.tag(TAG => example.id) { example.run }
        ensure
          profile = stop(recorder)
        end
        return unless profile

        formats = RSpec.formats(options[:format] || options[:formats], "the :rubyspy metadata of #{example.id}") ||
                  @settings.formats || EXAMPLE_FORMATS
        # Every thread's samples (a system spec's server thread too), named by the example.
        paths = write(profile.with_tag(TAG, example.id),
                      File.join(@settings.dir, "examples", RSpec.file_name(example)), formats)
        @written.concat(paths)
      end

      private

      def rate
        @settings.rate || DEFAULT_RATE
      end

      def example_rate(options)
        value = options[:rate]
        return rate if value.nil?
        return value if RubySpy::RSpec.valid_rate?(value)

        RSpec.warn_once("rubyspy: { rate: #{value.inspect} } is not a rate in Hz between 0 and #{RubySpy::RSpec.max_rate}; " \
                        "using #{rate}")
        rate
      end

      def start_recorder(hz)
        RSpec.load_core
        RubySpy::Recorder.new(Process.pid, rate: hz).start
      rescue RubySpy::Error, SystemCallError, ArgumentError, TypeError => e
        RSpec.warn_once("could not start recording (#{e.class}: #{e.message}); not profiling")
        nil
      end

      def stop(recorder)
        recorder.stop
      rescue RubySpy::Error => e
        RSpec.warn_once("recording failed (#{e.message})")
        nil
      end

      # Writes +profile+ as +base.<ext>+ for each format; returns the paths written.
      def write(profile, base, formats)
        FileUtils.mkdir_p(File.dirname(base))
        formats.map do |format|
          profile.write("#{base}.#{RubySpy::Profile::EXTENSIONS.fetch(format)}", format: format)
        end
      rescue SystemCallError, IOError, RubySpy::Error => e
        RSpec.warn_once("could not write profiles under #{File.dirname(base)} (#{e.message}); " \
                        "set RUBYSPY_DIR to a writable directory")
        []
      end

      def finish(recorder, name, what)
        profile = stop(recorder)
        return unless profile

        formats = (@settings.formats || SUITE_FORMATS) | [:raw]
        paths = write(profile, File.join(@settings.dir, name), formats)
        # All the work of the run: before(:suite) hooks and threads count as much as examples.
        summarize(profile, what, paths)
      end

      def summarize(profile, what, paths)
        out.puts
        out.puts format("rubyspy: %<what>s, %<n>d samples at %<hz>g Hz over %<s>.1f s%<to>s",
                        what: what, n: profile.samples, hz: profile.rate, s: profile.duration,
                        to: paths.empty? ? "" : ", written to #{paths.join(", ")}")
        total = profile.samples
        return out.puts("rubyspy: no samples") if total.zero?

        out.puts "  self%  total%  function"
        profile.functions(limit: SUMMARY_FUNCTIONS).each do |f|
          where = f[:path].empty? ? " (C function)" : " (#{f[:path].delete_prefix("#{Dir.pwd}/")})"
          out.puts format("%6.1f%% %6.1f%%  %s%s", 100.0 * f[:self] / total, 100.0 * f[:total] / total,
                          f[:label], where)
        end
      end

      def pick_examples
        examples = ::RSpec.world.ordered_example_groups.flat_map do |group|
          group.descendants.flat_map { |g| ::RSpec.world.filtered_examples[g] }
        end
        examples.map(&:id).sample(@settings.sample, random: Random.new(@config.seed || 0))
      end

      def out
        @config.output_stream || $stdout
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
