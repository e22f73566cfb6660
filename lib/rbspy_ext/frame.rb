# frozen_string_literal: true

module RubySpy
  # One frame of a snapshot, innermost first, shaped like Thread::Backtrace::Location.
  class Frame
    # @return [String] the label qualified the way Ruby 3.4 prints it on every version,
    #   e.g. "Billing::Invoice#total", "block (2 levels) in Foo.build", "Array#each"
    attr_reader :label
    # @return [String] the bare method (or block owner) name, e.g. "total", "each"
    attr_reader :base_label
    # @return [String, nil] the path as Ruby's Location#path gives it (for a C function, the
    #   path of the Ruby frame that called it; nil for a C function no Ruby code called)
    attr_reader :path
    # @return [String, nil] the absolute path as Ruby's Location#absolute_path gives it
    attr_reader :absolute_path
    # @return [Integer] the line executing in this frame (for a C function, the caller's line)
    attr_reader :lineno

    # @api private
    # Builds a frame from the native layer's row
    # +[label, base_label, path, absolute_path, lineno, c_function]+.
    # @return [RubySpy::Frame]
    def self.from_row(row)
      label, base_label, path, absolute_path, lineno, c_function = row
      new(label: label, base_label: base_label, path: path, absolute_path: absolute_path,
          lineno: lineno, c_function: c_function)
    end

    # @param label [String]
    # @param base_label [String]
    # @param path [String, nil]
    # @param absolute_path [String, nil]
    # @param lineno [Integer]
    # @param c_function [Boolean] whether the frame is a method written in C
    def initialize(label:, base_label:, path:, absolute_path:, lineno:, c_function:)
      @label = label
      @base_label = base_label
      @path = path
      @absolute_path = absolute_path
      @lineno = lineno
      @c_function = c_function
      freeze
    end

    # @return [Boolean] true for a method implemented in C (Ruby shows the caller's location)
    def c_function?
      @c_function
    end

    # The frame in Ruby's own backtrace-line format, as Ruby 3.4 prints it with qualified
    # labels: "app.rb:12:in 'Foo#bar'".
    # @return [String]
    def to_s
      "#{path}:#{lineno}:in '#{label}'"
    end

    # @return [String]
    def inspect
      "#<RubySpy::Frame #{self}#{" (C)" if c_function?}>"
    end

    # @return [Hash{Symbol=>Object}]
    def to_h
      { label: label, base_label: base_label, path: path, absolute_path: absolute_path,
        lineno: lineno, c_function: c_function? }
    end

    # @return [Boolean] true when every attribute is equal
    def ==(other)
      other.is_a?(Frame) && to_h == other.to_h
    end
    alias eql? ==

    # @return [Integer]
    def hash
      to_h.hash
    end
  end
end
