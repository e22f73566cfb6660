# frozen_string_literal: true

module RubySpy
  # An immutable set of tags (Symbol keys, any values) that can be made the current fiber's
  # context. The current fiber's state is published through the exported thread-local
  # +ruby_profiler_state+ (see docs/profiler-state.md), where the profiler's sampler and BPF
  # programs read it from outside the process. Values are kept alive (and not moved by
  # +GC.compact+) for as long as a state holds them.
  #
  # Most code wants {RubySpy.tag}; frameworks that keep their own context can build states:
  # @example
  #   base = RubySpy::State.new(service: "billing")
  #   base.with(request_id: id).apply!
  class State
    class << self
      # @param pairs [Hash{Symbol => Object}]
      # @return [RubySpy::State]
      # @raise [TypeError] for a key that is not a Symbol
      # @raise [ArgumentError] for more than 1024 tags
      def new(**pairs)
        build(pairs)
      end
    end

    # A new state with +pairs+ merged over this one's tags.
    # @param pairs [Hash{Symbol => Object}]
    # @return [RubySpy::State]
    # @raise (see .new)
    def with(**pairs)
      with_hash(pairs)
    end

    # Makes this state the current fiber's (replacing whatever it had). With the OpenTelemetry
    # bridge on, a state made before its request's span was renamed (routed) is applied as a
    # copy naming the endpoint of now, which {State.current} then returns.
    # @return [self]
    def apply!
      State.apply(self)
      self
    end

    # @return [String]
    def inspect
      "#<RubySpy::State #{to_h.inspect}>"
    end
    alias to_s inspect

    # @return [Boolean] same tags with the same values
    def ==(other)
      other.is_a?(State) && to_h == other.to_h
    end
    alias eql? ==

    # @return [Integer]
    def hash
      to_h.hash
    end
  end

  class << self
    # @!method tag(**pairs)
    #   Runs the block with +pairs+ merged over the current fiber's tags; the previous tags
    #   come back when the block exits, by exception, +break+ or +throw+ too. Fibers and
    #   threads created inside start with the tags current when they were created.
    #   (Defined in Rust, ext/rbspy_ext/src/tag.rs: Rails runs it for every request.)
    #
    #   @param pairs [Hash{Symbol => Object}]
    #   @return the block's value
    #   @raise [ArgumentError] without a block, for a positional argument, or for more than
    #     1024 tags
    #   @raise [TypeError] for a key that is not a Symbol
    #   @example
    #     RubySpy.tag(request_id: request.uuid, endpoint: "orders#show") { handle(request) }

    # The current fiber's tags.
    # @return [Hash{Symbol => Object}] empty when there are none
    def tags
      State.current&.to_h || {}
    end
  end

  # Starts a new fiber or thread with the tags current where it was created (Ruby's
  # fiber-locals start empty).
  module InheritTags
    # +block+ made to apply the creating fiber's state before it runs; +block+ itself when
    # there is no state (or no block).
    def self.wrap(block)
      state = State.current
      return block unless state && block

      proc do |*a, **k|
        State.apply(state)
        block.call(*a, **k)
      end
    end

    def initialize(*args, **kwargs, &block)
      super(*args, **kwargs, &InheritTags.wrap(block))
    end
  end
  # Thread.start and Thread.fork create a thread without calling #initialize.
  module InheritTagsOnStart
    %i[start fork].each do |name|
      define_method(name) do |*args, **kwargs, &block|
        super(*args, **kwargs, &InheritTags.wrap(block))
      end
    end
  end
  private_constant :InheritTags, :InheritTagsOnStart
  Fiber.prepend(InheritTags)
  Thread.prepend(InheritTags)
  Thread.singleton_class.prepend(InheritTagsOnStart)
end
