# frozen_string_literal: true

module RubySpy
  # Stand-ins for what the extension defines, loaded instead of it where the spy cannot run
  # (see {RubySpy::Native}). Each entry point into native code raises
  # {RubySpy::UnsupportedPlatform}; tags are accepted and dropped, so an application that tags
  # its work boots and runs unchanged.
  # @api private
  module Unsupported
    def self.raise_error
      raise UnsupportedPlatform, Native.unsupported_message
    end
  end

  class NativeHandle
    # @api private
    def self.open(*)
      Unsupported.raise_error
    end
  end

  class NativeRecorder
    # Nothing records here: no rate is too high to be refused for that reason instead.
    MAX_RATE_HZ = Float::INFINITY

    # @api private
    def self.start(*)
      Unsupported.raise_error
    end
  end

  class NativeServer
    # @api private
    def self.start(*)
      Unsupported.raise_error
    end
  end

  # A census is the extension's own data: none is taken or read here.
  class NativeCensus
    # @api private
    def self.from_json(*)
      Unsupported.raise_error
    end
  end

  # Nothing is tracked here.
  module NativeAllocations
    # @api private
    def self.start(*)
      Unsupported.raise_error
    end

    # @api private
    def self.stop; end

    # @api private
    def self.snapshot; end
  end

  class NativeProfile
    # Nothing renders here.
    FORMATS = {}.freeze
    VIEW_FORMATS = [].freeze

    # @api private
    def self.load(*)
      Unsupported.raise_error
    end
  end

  # A state that is never published: {State.current} stays nil, so {RubySpy.tags} is empty.
  class State
    class << self
      # @api private
      def build(pairs)
        bad = pairs.keys.reject { |k| k.is_a?(Symbol) }
        raise TypeError, "tag keys must be Symbols, got #{bad.map(&:inspect).join(', ')}" unless bad.empty?

        state = allocate
        state.instance_variable_set(:@pairs, pairs.dup.freeze)
        state
      end

      # @api private
      def current
        nil
      end

      # @api private
      def apply(_state)
        nil
      end
    end

    # @api private
    def with_hash(pairs)
      State.build(@pairs.merge(pairs))
    end

    # @api private
    def to_h
      @pairs.dup
    end

    # @api private
    def size
      @pairs.size
    end
  end

  class << self
    # The extension's RubySpy.tag (ext/rbspy_ext/src/tag.rs) checks its arguments the same
    # way, then runs the block: nothing is published here.
    # @api private
    def tag(**pairs)
      raise ArgumentError, "RubySpy.tag needs a block: the tags hold while it runs" unless block_given?

      State.build(pairs)
      yield
    end
  end
end
