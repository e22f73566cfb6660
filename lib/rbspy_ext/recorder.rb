# frozen_string_literal: true

module RubySpy
  # The highest sampling rate a recording takes, in Hz (the extension's limit).
  MAX_RATE = NativeRecorder::MAX_RATE_HZ

  # Whether +value+ is a sampling rate a recording takes: a positive Numeric up to {MAX_RATE}.
  # @param value [Object]
  # @return [Boolean]
  def self.valid_rate?(value)
    value.is_a?(Numeric) && value.positive? && value <= MAX_RATE
  end

  # How a recording runs. Every option has a default; pass only what you change.
  #
  # @!attribute rate [Numeric] samples per second, jittered (default 99; at most {MAX_RATE})
  # @!attribute duration [Numeric, nil] stop after this many seconds (default: until #stop)
  # @!attribute threads [Symbol] +:all+ (every Ruby thread, the default) or +:gvl+ (only
  #   the thread holding the GVL)
  # @!attribute on_cpu [Boolean] keep only samples of threads that hold the GVL
  # @!attribute subprocesses [Boolean] also record Ruby processes descending from the
  #   target (preforking servers); new ones are picked up within half a second
  # @!attribute force_version [String, nil] Ruby version whose layout to use
  # @!attribute live [Boolean] keep the profile so far for {Recorder#profile_so_far},
  #   refreshed every half second
  # @!attribute mode [Symbol] +:user+ (the default: a sampler thread reads the target's memory
  #   at each tick, every thread in whatever state) or +:bpf+ (a BPF program samples threads
  #   on a CPU, in the kernel, without waking anyone per sample: a CPU profile at a fraction
  #   of the cost; needs root or CAP_BPF and CAP_PERFMON, else {BpfUnavailable})
  RecordOptions = Struct.new(:rate, :duration, :threads, :on_cpu, :subprocesses, :force_version, :live,
                             :mode, keyword_init: true) do
    # @raise [ArgumentError, TypeError] for an option that cannot be honoured
    def initialize(rate: 99, duration: nil, threads: :all, on_cpu: false, subprocesses: false,
                   force_version: nil, live: false, mode: :user)
      super
      validate!
      freeze
    end

    private

    def validate!
      raise TypeError, "rate must be a Numeric, got #{rate.class}" unless rate.is_a?(Numeric)
      raise ArgumentError, "rate must be positive, got #{rate}" unless rate.positive?
      raise ArgumentError, "rate #{rate} Hz is above the maximum of #{MAX_RATE.to_i} Hz" if rate > MAX_RATE
      unless duration.nil? || (duration.is_a?(Numeric) && duration.positive? && duration.finite?)
        raise ArgumentError, "duration must be a positive number of seconds or nil, got #{duration.inspect}"
      end
      raise ArgumentError, "mode must be :user or :bpf, got #{mode.inspect}" unless %i[user bpf].include?(mode)
      return if %i[all gvl].include?(threads)

      raise ArgumentError, "threads must be :all or :gvl, got #{threads.inspect}"
    end
  end

  # Samples a process on a native thread (it never takes the GVL and never signals the
  # target, so it can record the calling process too) until stopped.
  #
  # @example
  #   recorder = RubySpy::Recorder.new(pid, rate: 999).start
  #   sleep 10
  #   profile = recorder.stop
  #   profile.write("profile.json", format: :speedscope)
  class Recorder
    # @return [Integer]
    attr_reader :pid
    # @return [RubySpy::RecordOptions]
    attr_reader :options

    # @param pid [Integer] the process to record; +Process.pid+ for this one
    # @param options [Hash] see {RecordOptions}
    def initialize(pid, **options)
      raise TypeError, "pid must be an Integer, got #{pid.class}" unless pid.is_a?(Integer)
      raise ArgumentError, "pid must be a positive process id, got #{pid}" unless pid.positive?

      @pid = pid
      @options = RecordOptions.new(**options)
      @native = nil
    end

    # Attaches and starts sampling. Errors (no such process, not Ruby...) are raised here.
    # @return [self]
    def start
      raise Error, "already started" if @native

      o = options
      @native = NativeRecorder.start(pid, { rate: o.rate.to_f, duration: o.duration&.to_f, threads: o.threads,
                                            on_cpu: o.on_cpu ? true : false,
                                            subprocesses: o.subprocesses ? true : false,
                                            force_version: o.force_version, live: o.live ? true : false,
                                            bpf: o.mode == :bpf })
      self
    end

    # @return [Boolean] true while sampling (false once stopped, the duration has passed, or
    #   the target exited)
    def running?
      !@native.nil? && !@native.progress[:finished]
    end

    # @return [Hash] +:elapsed+ seconds, +:ticks+ attempted, +:samples+ taken so far, and
    #   +:top+, the 10 functions most often on top of a stack (+[label, samples]+ pairs,
    #   refreshed every half second)
    def progress
      return { elapsed: 0.0, ticks: 0, samples: 0, top: [] } unless @native

      @native.progress.tap { |h| h.delete(:finished) }
    end

    # The samples so far, for a recording started with +live: true+ (refreshed every half
    # second; nil before the first refresh and without +live+).
    # @return [RubySpy::Profile, nil]
    def profile_so_far
      native = @native&.profile_so_far
      native && Profile.new(native)
    end

    # Waits until the recording ends by itself (duration or target exit).
    # @return [self]
    def wait
      sleep 0.01 while running?
      self
    end

    # Stops sampling.
    # @return [RubySpy::Profile]
    def stop
      raise Error, "not started" unless @native

      Profile.new(@native.stop)
    end
  end

  class << self
    # Records +pid+ while the block runs, or for +duration:+ seconds.
    #
    # @param pid [Integer]
    # @param options [Hash] see {RecordOptions}
    # @yield the work to record (optional when +duration:+ is given)
    # @return [RubySpy::Profile]
    # @raise [ArgumentError] with neither a block nor a duration
    # @example
    #   profile = RubySpy.record(Process.pid, rate: 999) { run_the_slow_thing }
    #   puts profile
    def record(pid, **options)
      raise ArgumentError, "give a block or duration:" unless block_given? || options[:duration]

      recorder = Recorder.new(pid, **options).start
      begin
        block_given? ? yield : recorder.wait
      ensure
        profile = recorder.stop
      end
      profile
    end
  end
end
