# frozen_string_literal: true

module RubySpyTest
  # Compares RubySpy frames with the ground truth Ruby recorded (Thread#backtrace_locations
  # or caller_locations), and renders the two side by side when they differ.
  module FrameComparison
    module_function

    # Ruby >= 3.4 labels methods the way RubySpy always does ("Billing::Invoice#total");
    # older Rubies print only the method name ("total").
    def qualified_labels?(ruby_version)
      (ruby_version.split(".").map(&:to_i) <=> [3, 4]) >= 0
    end

    BLOCK_OR_CLAUSE_PREFIX = /\A(?:(?:rescue|ensure) in |block (?:\(\d+ levels\) )?in )*/.freeze
    QUALIFIER = /\A[A-Z]\w*(?:::[A-Z]\w*)*[#.](?=.)/.freeze

    # Drops the "Const::Path#" / "Const::Path." qualification from the method-name part of
    # a Ruby 3.4 style label, giving what Ruby < 3.4 prints:
    #   "Billing::Invoice#total"           -> "total"
    #   "block (2 levels) in Foo::Bar#baz" -> "block (2 levels) in baz"
    #   "Array#each"                       -> "each"
    #   "<main>", "block in <main>"        -> unchanged
    def unqualify(label)
      prefix = label[BLOCK_OR_CLAUSE_PREFIX]
      prefix + label[prefix.length..].sub(QUALIFIER, "")
    end

    # Ruby 3.4's label rule gives a rescue/ensure clause the label of the code it belongs to
    # (3.4 also merges such frames into their parent, which older Rubies list separately).
    # On older Rubies either "rescue in foo" or "foo" is therefore a faithful rendering.
    def strip_clause(label)
      label.sub(/\A(?:(?:rescue|ensure) in )+/, "")
    end

    def label_matches?(actual, expected, ruby_version)
      return actual == expected if qualified_labels?(ruby_version)

      bare = unqualify(actual)
      bare == expected || bare == strip_clause(expected)
    end

    # Names of the fields of actual frame +a+ that differ from expected frame +e+.
    def frame_differences(a, e, ruby_version)
      diffs = []
      diffs << :path unless a.path == e.path
      diffs << :lineno unless a.lineno == e.lineno
      diffs << :absolute_path unless a.absolute_path == e.absolute_path
      diffs << :base_label unless a.base_label == e.base_label
      diffs << :label unless label_matches?(a.label, e.label, ruby_version)
      diffs
    end

    # [] when +actual+ matches +expected+ frame for frame; otherwise lines describing each
    # problem.
    def problems(actual, expected, ruby_version)
      list = []
      if actual.size != expected.size
        list << "expected #{expected.size} frames, got #{actual.size}"
      end
      [actual.size, expected.size].min.times do |i|
        diffs = frame_differences(actual[i], expected[i], ruby_version)
        list << "frame #{i}: #{diffs.join(", ")} differ" unless diffs.empty?
      end
      list
    end

    # A side-by-side table, one row per index, mismatching rows marked with "!".
    def side_by_side(actual, expected, ruby_version)
      left = expected.map { |e| format_frame(e) }
      right = actual.map { |a| format_frame(a) }
      width = [left.map(&:length).max || 0, 40].max
      header = format("  %4s  %-#{width}s | %s", "#",
                      "expected (Ruby #{ruby_version} backtrace_locations)", "actual (RubySpy)")
      rows = Array.new([left.size, right.size].max) do |i|
        bad = i >= actual.size || i >= expected.size ||
              !frame_differences(actual[i], expected[i], ruby_version).empty?
        note = bad && i < actual.size && i < expected.size ?
               "   <- #{frame_differences(actual[i], expected[i], ruby_version).join(", ")}" : ""
        format("%s %4d  %-#{width}s | %s%s", bad ? "!" : " ", i, left[i] || "(none)",
               right[i] || "(none)", note)
      end
      ([header] + rows).join("\n")
    end

    def format_frame(frame)
      path = shorten(frame.path)
      abs = frame.absolute_path.nil? ? "nil" : shorten(frame.absolute_path)
      abs = "=" if frame.absolute_path && frame.absolute_path == File.expand_path(frame.path, ROOT)
      c = frame.respond_to?(:c_function?) && frame.c_function? ? " (C)" : ""
      "#{path}:#{frame.lineno}:in '#{frame.label}' [#{frame.base_label}] abs:#{abs}#{c}"
    end

    def shorten(path)
      path.to_s.start_with?("#{ROOT}/") ? "./#{path[(ROOT.length + 1)..]}" : path.to_s
    end

    # Ground truth from Thread::Backtrace::Location objects in this process.
    def expected_from_locations(locations)
      locations.map do |loc|
        ExpectedFrame.new(label: loc.label, base_label: loc.base_label, path: loc.path,
                          absolute_path: loc.absolute_path, lineno: loc.lineno)
      end
    end
  end
end

# expect(frames).to match_backtrace(expected_frames, ruby_version: "3.1.2")
#
# (|*args| rather than |expected, ruby_version: ...|: before Ruby 3.2 a block taking one
# positional argument and keywords splats an Array passed alone into its elements.)
RSpec::Matchers.define :match_backtrace do |*args|
  options = args.last.is_a?(Hash) ? args.pop : {}
  expected = args.fetch(0)
  ruby_version = options.fetch(:ruby_version, RUBY_VERSION)

  match do |actual|
    @problems = RubySpyTest::FrameComparison.problems(actual, expected, ruby_version)
    @problems.empty?
  end

  failure_message do |actual|
    rule = if RubySpyTest::FrameComparison.qualified_labels?(ruby_version)
             "labels compared exactly"
           else
             "labels compared after removing RubySpy's Const::Path# / Const::Path. qualifier"
           end
    "snapshot differs from Ruby's own backtrace (#{rule}):\n  " +
      @problems.join("\n  ") + "\n\n" +
      RubySpyTest::FrameComparison.side_by_side(actual, expected, ruby_version)
  end
end
