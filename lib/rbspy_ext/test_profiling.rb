# frozen_string_literal: true

require "fileutils"
# Plain Ruby (no extension): the format names and the error classes.
require_relative "error"
require_relative "native"
require_relative "profile"
require_relative "test_allocations"

module RubySpy
  # What the test-framework integrations (rbspy_ext/rspec, rbspy_ext/minitest) share: the
  # settings they read from the environment (RUBYSPY, RUBYSPY_SAMPLE, RUBYSPY_RATE,
  # RUBYSPY_FORMAT, RUBYSPY_DIR, RUBYSPY_STATE_LEAVES), and a {Session} of recordings, files
  # and the summary.
  module TestProfiling
    DEFAULT_RATE = 999
    DEFAULT_DIR = "tmp/rubyspy"
    SUITE_FORMATS = %i[speedscope flamegraph].freeze
    EXAMPLE_FORMATS = %i[speedscope].freeze
    # The tag each test's samples carry (RSpec calls tests examples).
    TAG = :example
    # How many functions the end-of-run summary lists.
    SUMMARY_FUNCTIONS = 10

    # What the environment asked for.
    # @!attribute mode [Symbol] +:off+, +:suite+ or +:boot+
    # @!attribute rate [Numeric, nil] RUBYSPY_RATE, when valid
    # @!attribute formats [Array<Symbol>, nil] RUBYSPY_FORMAT, when valid
    # @!attribute dir [String]
    # @!attribute sample [Integer] how many random tests to profile (0: none)
    # @!attribute state_leaves [Boolean] waits for the GVL and GC pauses as leaves of their own
    #   in the files and the summary (+[waiting for GVL]+...); RUBYSPY_STATE_LEAVES=0 turns
    #   them off
    # @!attribute allocations [Integer, nil] RUBYSPY_ALLOCATIONS=1: track the suite's
    #   allocations at this rate (RUBYSPY_ALLOCATION_RATE bytes, default 512 KiB)
    Settings = Struct.new(:mode, :rate, :formats, :dir, :sample, :state_leaves, :allocations, keyword_init: true)

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
                     sample: sample(env["RUBYSPY_SAMPLE"]),
                     state_leaves: !%w[0 false no off].include?(env["RUBYSPY_STATE_LEAVES"].to_s.strip.downcase),
                     allocations: AllocationTracking.suite_rate(env))
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

      # The file name a test's profile gets: its id (+./spec/a_spec.rb[1:2]+,
      # +OrderTest#test_total+) made safe for a file name (+spec-a_spec.rb-1-2+,
      # +OrderTest-test_total+), stable across runs.
      # @param id [String]
      # @return [String]
      def file_name(id)
        id.delete_prefix("./").gsub(/[^A-Za-z0-9_.-]+/, "-").gsub(/\A-+|-+\z/, "")
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
        return rate if valid_rate?(rate)

        warn_once("RUBYSPY_RATE=#{value} is not a rate in Hz between 0 and #{max_rate}; " \
                  "using #{DEFAULT_RATE}")
        nil
      end

      def sample(value)
        return 0 if value.nil? || value.strip.empty?

        n = Integer(value, exception: false)
        return n if n && n >= 0

        warn_once("RUBYSPY_SAMPLE=#{value} is not a number of tests; sampling none")
        0
      end
    end

    # One run of a suite: the recorders it keeps, the files it writes, and the summary it
    # prints. The framework integrations call it from their hooks.
    # @api private
    class Session
      # @param settings [Settings]
      # @param out [#call] returns the IO the summary goes to
      # @param worker [String, nil] a parallel worker's number: its suite files are
      #   +suite.<worker>.*+, so that workers do not overwrite each other
      # @param noun [String] what the framework calls a test, for messages
      # @param sampled [Array<String>, nil] the tests RUBYSPY_SAMPLE picked (see {#pick})
      def initialize(settings, out, worker: nil, noun: "test", sampled: nil)
        @settings = settings
        @out = out
        @worker = worker
        @noun = noun
        @sampled = sampled
        @written = []
      end

      # A session for a parallel worker forked from this one: the same settings and picks
      # (RUBYSPY_SAMPLE), its own recordings, and suite files named +suite.<worker>.*+.
      # @param worker [String]
      # @return [Session]
      def for_worker(worker)
        Session.new(@settings, @out, worker: worker, noun: @noun, sampled: @sampled)
      end

      # Starts recording the load of the suite (RUBYSPY=boot).
      def start_boot
        @boot = start_recorder(rate) if @settings.mode == :boot
      end

      # Ends the boot recording, if any, and starts the suite's (RUBYSPY=1).
      def start_suite
        finish(@boot, "boot", "the load of the suite") if @boot
        @boot = nil
        @suite = start_recorder(rate) if @settings.mode == :suite
        @allocations = @settings.allocations && AllocationTracking.start(@settings.allocations)
      end

      # Ends the suite's recording: its files, its summary, and the count of test profiles.
      def end_suite
        name = @worker ? "suite.#{@worker}" : "suite"
        finish(@suite, name, "the suite") if @suite
        @suite = nil
        finish_allocations(File.join(@settings.dir, name), "the suite") if @allocations
        @allocations = false
        return if @written.empty?

        out.puts "rubyspy: #{@written.size} #{@noun} profile#{"s" unless @written.size == 1} in " \
                 "#{File.join(@settings.dir, "examples")}/"
      end

      # Picks the RUBYSPY_SAMPLE tests to profile among +ids+, from +seed+ (the same seed
      # picks the same ones).
      def pick(ids, seed)
        @sampled = ids.sample(@settings.sample, random: Random.new(seed || 0)) if @settings.sample.positive?
      end

      # Whether the test +id+ was picked by RUBYSPY_SAMPLE.
      def sampled?(id)
        @sampled&.include?(id) || false
      end

      # Runs a test, tagged with its id while the suite is recorded.
      def tagged(id, &test)
        @suite ? RubySpy.tag(TAG => id, &test) : test.call
      end

      # Runs a test under a recording of its own and writes that profile: every thread's
      # samples while it ran, each tagged with +id+. +options+: +rate:+ and +format:+, from
      # +source+ (for warnings).
      # @return what the test returned
      def profile_one(id, options, source, &test)
        if options.key?(:allocations)
          return allocations_one(id, AllocationTracking.test_rate(options[:allocations], source), &test)
        end

        recorder = start_recorder(test_rate(options))
        return test.call unless recorder

        begin
          result = RubySpy.tag(TAG => id, &test)
        ensure
          profile = stop(recorder)
        end
        write_test_profile(id, options, source, profile) if profile
        result
      end

      private

      # One test's allocations (+allocations:+ in its options) instead of its samples.
      def allocations_one(id, rate, &test)
        if @allocations
          TestProfiling.warn_once("RUBYSPY_ALLOCATIONS tracks the whole suite: no #{@noun} tracks its own")
          rate = nil
        end
        return test.call unless rate && AllocationTracking.start(rate)

        begin
          result = RubySpy.tag(TAG => id, &test)
        ensure
          base = File.join(@settings.dir, "examples", TestProfiling.file_name(id))
          _, paths = AllocationTracking.finish(base)
          # One profile (its text summary beside it), as the end-of-run count says.
          @written << paths.first if paths
        end
        result
      end

      def finish_allocations(base, what)
        allocations, paths = AllocationTracking.finish(base)
        return unless allocations

        out.puts
        AllocationTracking.summary(allocations, what, paths).each { |line| out.puts line }
      end

      def write_test_profile(id, options, source, profile)
        formats = TestProfiling.formats(options[:format] || options[:formats], source) ||
                  @settings.formats || EXAMPLE_FORMATS
        # Every thread's samples (a system test's server thread too), named by the test.
        paths = write(profile.with_tag(TAG, id), File.join(@settings.dir, "examples", TestProfiling.file_name(id)),
                      formats)
        @written.concat(paths)
      end

      def rate
        @settings.rate || DEFAULT_RATE
      end

      def test_rate(options)
        value = options[:rate]
        return rate if value.nil?
        return value if TestProfiling.valid_rate?(value)

        TestProfiling.warn_once("{ rate: #{value.inspect} } is not a rate in Hz between 0 and " \
                                "#{TestProfiling.max_rate}; using #{rate}")
        rate
      end

      def start_recorder(hz)
        TestProfiling.load_core
        RubySpy::Recorder.new(Process.pid, rate: hz).start
      rescue RubySpy::Error, SystemCallError, ArgumentError, TypeError => e
        TestProfiling.warn_once("could not start recording (#{e.class}: #{e.message}); not profiling")
        nil
      end

      def stop(recorder)
        recorder.stop
      rescue RubySpy::Error => e
        TestProfiling.warn_once("recording failed (#{e.message})")
        nil
      end

      # Writes +profile+ as +base.<ext>+ for each format; returns the paths written. A format
      # that cannot render this profile (a flame graph of no samples) is said so and skipped;
      # the others are still written.
      def write(profile, base, formats)
        FileUtils.mkdir_p(File.dirname(base))
        formats.filter_map do |format|
          path = "#{base}.#{RubySpy::Profile::EXTENSIONS.fetch(format)}"
          profile.write(path, format: format, state_leaves: @settings.state_leaves)
        rescue RubySpy::Error => e
          TestProfiling.warn_once("no #{format} of #{File.basename(base)}: #{e.message}")
          nil
        end
      rescue SystemCallError, IOError => e
        TestProfiling.warn_once("could not write profiles under #{File.dirname(base)} (#{e.message}); " \
                                "set RUBYSPY_DIR to a writable directory")
        []
      end

      def finish(recorder, name, what)
        profile = stop(recorder)
        return unless profile

        # raw first: it keeps everything, whatever happens to the others.
        formats = [:raw] | (@settings.formats || SUITE_FORMATS)
        paths = write(profile, File.join(@settings.dir, name), formats)
        # All the work of the run: before-suite hooks and threads count as much as tests.
        summarize(profile, what, paths)
      end

      def summarize(profile, what, paths)
        out.puts
        out.puts format("rubyspy: %<what>s, %<n>d samples at %<hz>g Hz over %<s>.1f s%<to>s",
                        what: what, n: profile.samples, hz: profile.rate, s: profile.duration,
                        to: paths.empty? ? "" : ", written to #{paths.join(", ")}")
        # Blocked threads (idle pools, a main thread waiting on workers) are left out, as the
        # flame graphs leave them out: they would crowd out where the time goes.
        blocked = profile.samples_in(:blocked)
        total = profile.samples - blocked
        return out.puts("rubyspy: no samples of threads at work") if total.zero?

        out.puts "  self%  total%  function#{"   (#{blocked} samples of blocked threads left out)" if blocked.positive?}"
        profile.functions(limit: SUMMARY_FUNCTIONS, idle: false, state_leaves: @settings.state_leaves).each do |f|
          where = if f[:state_leaf] then ""
                  elsif f[:path].empty? then " (C function)"
                  else " (#{f[:path].delete_prefix("#{Dir.pwd}/")})"
                  end
          out.puts format("%6.1f%% %6.1f%%  %s%s", 100.0 * f[:self] / total, 100.0 * f[:total] / total,
                          f[:label], where)
        end
      end

      def out
        @out.call
      end
    end
  end
end
