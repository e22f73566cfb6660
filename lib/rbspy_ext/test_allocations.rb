# frozen_string_literal: true

module RubySpy
  module TestProfiling
    # What the test integrations do with allocations: track the suite's
    # (+RUBYSPY_ALLOCATIONS=1+, sampled at +RUBYSPY_ALLOCATION_RATE+ bytes or 512 KiB) or one
    # test's (+rubyspy: { allocations: true }+, every allocation; or +allocations: bytes+),
    # then write Go's allocation profile (+NAME.allocs.pb.gz+, opening on +alloc_space+; its
    # +inuse_+ types are what the test left alive after a full GC) and the text summary
    # (+NAME.allocs.txt+), and print the top source lines.
    # @api private
    module AllocationTracking
      # Source lines the end-of-run summary lists.
      TOP_LINES = 5

      module_function

      # The suite's rate from +env+: nil unless RUBYSPY_ALLOCATIONS asks for tracking.
      # @param env [Hash{String => String}]
      # @return [Integer, nil]
      def suite_rate(env)
        return nil unless %w[1 true yes on].include?(env["RUBYSPY_ALLOCATIONS"].to_s.strip.downcase)

        text = env["RUBYSPY_ALLOCATION_RATE"].to_s.strip
        return 512 * 1024 if text.empty?

        rate = Integer(text, 10, exception: false)
        return rate if rate&.positive?

        TestProfiling.warn_once("RUBYSPY_ALLOCATION_RATE=#{text} is not a positive number of bytes; using 512 KiB")
        512 * 1024
      end

      # A test's rate from its options' +allocations:+ (true: every allocation).
      # @return [Integer, nil] nil when the option is absent or unusable (said once)
      def test_rate(value, source)
        return nil if value.nil? || value == false
        return 1 if value == true
        return value if value.is_a?(Integer) && value.positive?

        TestProfiling.warn_once("{ allocations: #{value.inspect} } in #{source} is not true or a positive " \
                                "number of bytes; not tracking its allocations")
        nil
      end

      # Starts tracking at +rate+; false (said once) when it cannot.
      # @return [Boolean]
      def start(rate)
        TestProfiling.load_core
        RubySpy.track_allocations(rate: rate)
        true
      rescue RubySpy::Error, ArgumentError, TypeError => e
        TestProfiling.warn_once("could not track allocations (#{e.class}: #{e.message})")
        false
      end

      # Collects the garbage (so in use is what the test kept), stops, and writes
      # +base.allocs.pb.gz+ and +base.allocs.txt+.
      # @return [Array(RubySpy::Allocations, Array<String>), nil] the allocations and the
      #   paths written
      def finish(base)
        GC.start
        allocations = RubySpy.stop_tracking_allocations
        return nil unless allocations

        FileUtils.mkdir_p(File.dirname(base))
        paths = [allocations.write("#{base}.allocs.pb.gz", opens: :allocs),
                 allocations.write("#{base}.allocs.txt", format: :summary)]
        [allocations, paths]
      rescue SystemCallError, IOError => e
        TestProfiling.warn_once("could not write allocations under #{File.dirname(base)} (#{e.message}); " \
                                "set RUBYSPY_DIR to a writable directory")
        nil
      end

      # The end-of-run lines: totals, then the source lines that allocated most bytes.
      # @param allocations [RubySpy::Allocations]
      # @return [Array<String>]
      def summary(allocations, what, paths)
        sites = allocations.sites
        objects = sites.sum { |s| s[:allocated] }
        bytes = sites.sum { |s| s[:allocated_bytes] }
        lines = ["rubyspy: allocations of #{what}: #{objects} objects, #{bytes} bytes of slots " \
                 "(one sample per #{allocations.rate} bytes), written to #{paths.join(", ")}"]
        by_line = sites.group_by { |s| where(s[:frames]) }.transform_values do |group|
          [group.sum { |s| s[:allocated_bytes] }, group.sum { |s| s[:allocated] }]
        end
        lines << "      bytes    objects  source line"
        by_line.sort_by { |line, (b, _)| [-b, line] }.first(TOP_LINES).each do |line, (b, n)|
          lines << format("%11d %10d  %s", b, n, line)
        end
        lines
      end

      # A site's innermost line of Ruby code, with the C function it called, if any.
      def where(frames)
        code = frames.find { |f| !f.c_function? }
        return "(no Ruby frame)" unless code

        called = frames.first.c_function? ? " (#{frames.first.label})" : ""
        "#{code.path.delete_prefix("#{Dir.pwd}/")}:#{code.lineno} #{code.label}#{called}"
      end
    end
  end
end
