# frozen_string_literal: true

module RubySpy
  # What a process allocated and still keeps, by the code that allocated it: the sampled
  # allocations that {RubySpy.track_allocations} counts in the calling process. Sampling is
  # by bytes, as Go's heap profiler samples (one sample every +rate+ bytes of slots on
  # average; an object is likelier to be sampled the more memory it takes), and the counts
  # are estimates already scaled to every allocation; +rate: 1+ counts every allocation
  # exactly. Objects a program cannot see (Ruby's internal memos, iclasses, hidden objects)
  # are not counted.
  class Allocations
    # Go's MemProfileRate: one sample every 512 KiB allocated, on average.
    DEFAULT_RATE = 512 * 1024
    # At the default rate, samples a second at most: a heavy allocator's samples then stand
    # for more bytes each (and weigh what they stand for), so its cost stays bounded.
    DEFAULT_MAX_SAMPLES_PER_SECOND = 100
    # At the default rate and cap, the share of one core tracking may spend: fewer samples
    # a second where each costs more (the tracker measures its wake-ups, jobs and hook).
    DEFAULT_MAX_CPU = 0.005
    # "1" tracks allocations from the moment the gem loads ({RubySpy.track_allocations_from_env}).
    ENV_ALLOCATIONS = "RUBYSPY_ALLOCATIONS"
    # The rate for {ENV_ALLOCATIONS}, in bytes (default {DEFAULT_RATE}).
    ENV_RATE = "RUBYSPY_ALLOCATION_RATE"

    # A forked child's tracking needs a timer of its own (the parent's is not inherited):
    # +Process._fork+ (Ruby 3.1+) gives it one.
    module ForkHook
      # @api private
      def _fork
        pid = super
        NativeAllocations.after_fork if pid.zero?
        pid
      end
    end

    # @api private
    def self.follow_forks
      return if !Process.respond_to?(:_fork) || Process.singleton_class.include?(ForkHook)

      Process.singleton_class.prepend(ForkHook)
    end

    # @api private
    def initialize(native)
      @native = native
    end

    # @return [Integer] mean bytes between samples (1: every allocation)
    def rate
      @native.rate
    end

    # @return [Float] seconds tracked when the snapshot was taken
    def duration
      @native.duration
    end

    # @return [Array<String>] what was not kept (sites or live objects past the bounds)
    def notes
      @native.notes
    end

    # Every allocation site: a stack (innermost frame first, as {RubySpy.snapshot} gives them),
    # the class and built-in type of the objects allocated there, and the estimates.
    # @return [Array<Hash>] +{frames: [RubySpy::Frame], class: String, type: String ("T_STRING"),
    #   samples: Integer, allocated: Integer, allocated_bytes: Integer, live: Integer,
    #   live_bytes: Integer}+, most live bytes first
    def sites
      frames = @native.frames.map { |row| Frame.from_row(row) }
      @native.sites.map { |site| site.merge(frames: site[:frames].map { |i| frames[i] }) }
             .sort_by { |s| [-s[:live_bytes], -s[:allocated_bytes]] }
    end

    # Go's heap profile of the allocations, gzipped pprof: sample types +alloc_objects+,
    # +alloc_space+, +inuse_objects+ and +inuse_space+, +class+ and +type+ labels, the
    # +bytes+ numeric label, period +space+/bytes = {#rate}.
    # @param opens [Symbol] +:heap+ (opens on inuse_space, as Go's /debug/pprof/heap) or
    #   +:allocs+ (alloc_space, as /debug/pprof/allocs)
    # @return [String] binary
    # @raise [ArgumentError] for another +opens+
    def pprof(opens: :heap)
      @native.pprof(opens.to_s)
    end

    # What a view counts: Go's sample types.
    MEASURES = %i[alloc_objects alloc_space inuse_objects inuse_space].freeze
    # The views {#render} draws (pprof is {#pprof}).
    VIEWS = %i[summary flamegraph speedscope collapsed].freeze

    # The allocations as a view: +:summary+ text (the top functions, source lines and classes),
    # or a +:flamegraph+ (SVG), +:speedscope+ (JSON) or +:collapsed+ drawing whose stacks each
    # end in the class allocated, "(String)". Counts are estimates of +measure+.
    # @param format [Symbol] one of {VIEWS}
    # @param measure [Symbol] one of {MEASURES}: objects or bytes, allocated or still in use
    # @return [String]
    # @raise [ArgumentError] for another format or measure
    # @example
    #   puts RubySpy.allocations.render(:summary, measure: :inuse_space)
    def render(format = :summary, measure: :alloc_space)
      raise ArgumentError, "format must be one of #{VIEWS.join(', ')} (pprof: #pprof), got #{format.inspect}" unless VIEWS.include?(format)
      raise ArgumentError, "measure must be one of #{MEASURES.join(', ')}, got #{measure.inspect}" unless MEASURES.include?(measure)

      @native.render(format.to_s, measure.to_s)
    end

    # Writes {#pprof} to +path+, or with +format+ a view ({#render}).
    # @param path [String]
    # @param opens [Symbol] see {#pprof}
    # @param format [Symbol, nil] one of {VIEWS}; nil: pprof
    # @param measure [Symbol] see {#render}
    # @return [String] the path
    def write(path, opens: :heap, format: nil, measure: :alloc_space)
      File.binwrite(path, format ? render(format, measure: measure) : pprof(opens: opens))
      path
    end

    # @return [String]
    def inspect
      "#<RubySpy::Allocations rate=#{rate} sites=#{@native.sites.size}>"
    end
  end

  class << self
    # Tracks the calling process's allocations, sampled: with a block, while it runs, and
    # returns what it allocated and what of it is still alive at its end (after a full GC,
    # which the block form runs); without one, from now until {stop_tracking_allocations}.
    # Starting again starts afresh. The allocation hook is on only near a sample point, and
    # each sample costs a stack walk; see docs/memory.md for the figures.
    #
    # Before Ruby 4.0 only the Ractor that starts tracking is tracked (Ruby keeps such hooks
    # per Ractor); from 4.0 every Ractor's allocations are.
    #
    # At the default rate samples are capped at
    # {Allocations::DEFAULT_MAX_SAMPLES_PER_SECOND} a second: past it, each sample stands for
    # more bytes (and weighs what it stood for), so the estimates stay unbiased and a heavy
    # allocator pays no more; what is given up is precision on small sites. A rate given
    # explicitly is kept unless +max_samples_per_second+ is given too. At the default rate and
    # cap the cap is lower where samples cost more than {Allocations::DEFAULT_MAX_CPU} of a
    # core (+max_cpu:+); the allocations' notes say when it was.
    # @param rate [Integer] mean bytes between samples; 1 samples every allocation
    # @param max_samples_per_second [Integer, nil] the cap (0: none); nil: the default cap at
    #   the default rate, none at a rate given
    # @param max_cpu [Numeric, nil] the share of one core samples may cost (0.01: 1 %), which
    #   lowers the cap as the tracker measures what a sample costs (0: no budget); nil: the
    #   default share with the default rate and cap, none otherwise
    # @return [RubySpy::Allocations, nil] with a block, its allocations; nil without one
    # @raise [ArgumentError] for a rate below 1, a negative cap or a +max_cpu+ outside 0..1
    # @raise [TypeError] for a rate or cap that is not an Integer, or a +max_cpu+ not a number
    # @example
    #   sites = RubySpy.track_allocations(rate: 1) { import_all }.sites
    #   sites.first(5).each { |s| puts "#{s[:live]} #{s[:class]} at #{s[:frames].first}" }
    def track_allocations(rate: nil, max_samples_per_second: nil, max_cpu: nil)
      defaults = rate.nil? && max_samples_per_second.nil?
      cap = max_samples_per_second || (rate ? 0 : Allocations::DEFAULT_MAX_SAMPLES_PER_SECOND)
      max_cpu ||= defaults ? Allocations::DEFAULT_MAX_CPU : 0
      unless max_cpu.is_a?(Numeric) && max_cpu.real?
        raise TypeError, "max_cpu must be a share of one core (0.01: 1 %), got #{max_cpu.class}"
      end
      unless max_cpu.between?(0, 1)
        raise ArgumentError, "max_cpu must be a share of one core from 0 (no budget) to 1, got #{max_cpu}"
      end
      # A budget with no cap asked for: the budget alone caps.
      cap = 10_000 if cap.is_a?(Integer) && cap.zero? && max_cpu.positive?
      rate ||= Allocations::DEFAULT_RATE
      raise TypeError, "rate must be an Integer number of bytes, got #{rate.class}" unless rate.is_a?(Integer)
      raise ArgumentError, "rate must be at least 1 byte (1: every allocation), got #{rate}" if rate < 1
      unless cap.is_a?(Integer)
        raise TypeError, "max_samples_per_second must be an Integer (0: no cap), got #{cap.class}"
      end
      raise ArgumentError, "max_samples_per_second must be 0 (no cap) or more, got #{cap}" if cap.negative?

      NativeAllocations.start(rate, cap, max_cpu.to_f)
      Allocations.follow_forks
      return nil unless block_given?

      begin
        yield
        NativeAllocations.collect
      ensure
        NativeAllocations.stop
      end
      allocations
    end

    # Starts tracking when {Allocations::ENV_ALLOCATIONS} is "1" (at
    # {Allocations::ENV_RATE} bytes a sample, or the default), unless it runs already. The gem
    # calls it when it loads, so the Railtie, the Puma plugin and a plain +require+ all read
    # it; a Puma worker forked from a tracking master keeps tracking.
    # @param env [Hash] the environment to read
    # @return [Boolean] whether it started tracking
    def track_allocations_from_env(env = ENV)
      return false unless env[Allocations::ENV_ALLOCATIONS].to_s.strip == "1"
      return false if NativeAllocations.tracking?

      text = env[Allocations::ENV_RATE].to_s.strip
      track_allocations(rate: text.empty? ? nil : Integer(text, 10))
      true
    rescue ArgumentError, TypeError => e
      warn "rbspy_ext: #{Allocations::ENV_RATE}=#{text}: not tracking allocations: #{e.message}"
      false
    end

    # What the tracking so far counted (also after it stopped), nil when it never ran. What
    # is in use is as of the last completed GC, as in Go: the sampled objects it kept;
    # those allocated since are counted as allocated only (a note says how many).
    # @param gc [Boolean] run a full GC first (and check it), as Go's `/debug/pprof/heap?gc=1`
    # @return [RubySpy::Allocations, nil]
    def allocations(gc: false)
      NativeAllocations.collect if gc && NativeAllocations.tracking?
      native = NativeAllocations.snapshot
      native && Allocations.new(native)
    end

    # Stops tracking; what it counted stays readable with {allocations}.
    # @return [RubySpy::Allocations, nil]
    def stop_tracking_allocations
      NativeAllocations.stop
      allocations
    end
  end
end
