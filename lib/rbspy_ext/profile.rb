# frozen_string_literal: true

module RubySpy
  # A finished recording: samples aggregated by thread, thread state and stack.
  class Profile
    # {FORMATS} and {EXTENSIONS} come from the extension's one table of formats
    # (lib/rbspy_ext/formats.rb), loaded when first used: the RSpec integration loads this
    # file without the extension.
    autoload :FORMATS, File.expand_path("formats", __dir__)
    autoload :EXTENSIONS, File.expand_path("formats", __dir__)
    autoload :VIEW_FORMATS, File.expand_path("formats", __dir__)

    # Loads a raw profile written by +write(path, format: :raw)+, to render it again.
    # @param path [String, #to_path]
    # @return [RubySpy::Profile]
    # @raise [RubySpy::InvalidProfile] for a truncated, corrupt or foreign file
    # @raise [TypeError] when +path+ is not a path
    # @raise [SystemCallError] when the file cannot be read at all (+Errno::ENOENT+,
    #   +Errno::EISDIR+, +Errno::EACCES+), naming it
    def self.load(path)
      path = path.to_path if path.respond_to?(:to_path)
      raise TypeError, "a profile path must be a String, got #{path.class}" unless path.is_a?(String)
      raise Errno::EISDIR, path if File.directory?(path)

      File.open(path, "rb") {} # the usual Errno for a missing or unreadable file
      new(NativeProfile.load(path))
    end

    # @api private
    def initialize(native)
      @native = native
    end

    # @return [Integer] thread stacks recorded
    def samples
      @native.samples
    end

    # @return [Integer] sampling ticks attempted
    def ticks
      @native.ticks
    end

    # @return [Float] seconds recorded
    def duration
      @native.duration
    end

    # @return [Integer] the recorded process
    def pid
      @native.pid
    end

    # @return [String] its Ruby version
    def ruby_version
      @native.ruby_version
    end

    # @return [String, nil] the JIT whose code the process ran at the end of the recording:
    #   "YJIT" (machine code in memory no file backs, from Ruby 3.1) or "ZJIT" (4.1), nil
    #   when none had made code
    def jit
      @native.jit
    end

    # @return [Float] the requested rate
    def rate
      @native.rate
    end

    # @return [Hash{String=>Integer}] samples dropped, by reason
    def errors
      @native.errors
    end

    # @return [Array<String>] what happened during the recording (e.g. the target exited)
    def notes
      @native.notes
    end

    # What recording cost the profiler (not the target).
    # @return [Hash] +:sampler_cpu+ seconds of CPU used by the sampler thread,
    #   +:sampling_cpu+ the part of it spent taking samples (the rest is the kernel waking the
    #   thread up), +:read_calls+ (+process_vm_readv+ calls), +:per_tick_us+ and
    #   +:sampling_per_tick_us+ the same per sampling tick. A recording by the BPF sampler
    #   (+mode: :bpf+) adds +:bpf_run_time+ seconds the program ran in the kernel (every run,
    #   other processes' ticks it filtered out included), +:bpf_runs+, +:bpf_per_run_us+,
    #   +:bpf_per_tick_us+ (its run time per sample kept) and +:wakeups+ of the recorder
    def cost
      cpu, work, calls, kernel = @native.cost
      per_tick = ->(seconds) { ticks.zero? ? 0.0 : seconds * 1e6 / ticks }
      cost = { sampler_cpu: cpu, sampling_cpu: work, read_calls: calls,
               per_tick_us: per_tick.(cpu), sampling_per_tick_us: per_tick.(work) }
      return cost unless kernel

      run_time, runs, wakeups = kernel
      cost.merge(bpf_run_time: run_time, bpf_runs: runs, wakeups: wakeups,
                 bpf_per_run_us: runs.zero? ? 0.0 : run_time * 1e6 / runs,
                 bpf_per_tick_us: per_tick.(run_time))
    end

    # @return [Array<Hash>] one per thread: +:pid+, +:tid+ (0 when unknown: an M:N thread
    #   asleep), +:ruby_thread+ (its +rb_thread_t+'s address, 0 for "ended threads"), +:name+,
    #   +:main+, +:ractor+ (its
    #   Ractor's id: 1 for the main one, 0 before Ruby 3.0), +:ractor_name+, +:states+
    #   (samples by state: "running", "waiting_for_gvl", "blocked", "gc_marking", "gc_sweeping",
    #   "gc_compacting", "gc" between GC phases, or with the BPF sampler "no_gvl": on a CPU
    #   without the GVL)
    def threads
      @native.threads
    end

    # Samples of threads in +state+, over every thread: +samples_in(:blocked)+ is what the
    # views leave out by default.
    # @param state [Symbol, String] a state of {#threads} (+:running+, +:blocked+...)
    # @return [Integer]
    def samples_in(state)
      threads.sum { |t| t[:states][state.to_s].to_i }
    end

    # The profile in +format+, as a String (binary for pprof).
    #
    # Every format but raw gives a sample whose thread waited for the GVL, or ran the GC, a
    # leaf frame of its own below the frame it stood in (+[waiting for GVL]+, +[GC marking]+,
    # +[GC sweeping]+, +[GC compacting]+, +[GC]+), so that a frame's self samples are the
    # samples it ran in; +state_leaves: false+ gives the shape before leaves.
    #
    # flamegraph, speedscope and collapsed ({VIEW_FORMATS}) merge every thread's stacks into
    # functions (label and path) and leave out the samples of blocked threads (sleeping, in
    # IO, waiting on a lock: idle), saying so in the flamegraph's subtitle and speedscope's
    # name. Each of the other keywords undoes one of those; the other formats take none of
    # them.
    # @param format [Symbol, String] one of {FORMATS}
    # @param tag [Symbol, String, nil] a root frame per value of this tag
    #   (+endpoint=orders#show+, +endpoint=-+ for samples without it); speedscope: a profile
    #   per value
    # @param per_thread [Boolean] a root frame per thread (speedscope: a profile per thread)
    # @param lines [Boolean] a frame per executing line (+label path:line+), not per function
    # @param idle [Boolean] keep the samples of blocked threads
    # @param state [Boolean] a root frame per thread state (+[running]+, +[waiting_for_gvl]+,
    #   +[gc_marking]+...)
    # @param state_leaves [Boolean] false: no leaf frames for waits and GC (every format)
    # @return [String]
    # @raise [ArgumentError] for an unknown format, or a keyword the format does not take
    # @example
    #   profile.render(:collapsed, per_thread: true, idle: true)
    def render(format, tag: nil, per_thread: false, lines: false, idle: false, state: false, state_leaves: true)
      @native.render(format.to_s, { tag: tag&.to_s, per_thread: per_thread ? true : false, lines: lines ? true : false,
                                    idle: idle ? true : false, state: state ? true : false,
                                    state_leaves: state_leaves ? true : false })
    end

    # Writes the profile to +path+.
    # @param path [String]
    # @param format [Symbol, String] one of {FORMATS}
    # @param view [Hash] the keywords of {#render}: +tag:+, +per_thread:+, +lines:+, +idle:+,
    #   +state:+, +state_leaves:+
    # @return [String] the path
    # @raise [ArgumentError] for an unknown format, or a keyword the format does not take
    # @raise [SystemCallError] when the path cannot be written
    def write(path, format:, **view)
      data = render(format, **view)
      File.binwrite(path, data)
      path
    end

    # Every set of tags the samples carried ({RubySpy.tag} in the target), with its samples.
    # @return [Array<Hash>] +{tags: {Symbol => String}, samples: Integer}+; samples without
    #   tags have +tags: {}+
    def tags
      @native.tag_sets.map { |set| set.merge(tags: set[:tags].to_h { |k, v| [k.to_sym, v] }) }
    end

    # The samples of threads in a state, of some threads, and whose tags have all these values
    # (compared as text, the way they were recorded: +user: 42+ matches the tag value "42").
    # +select(state: :running).functions+ gives each function the samples it ran in, which
    # every view of the whole profile bills to it (beside its blocked ones), its waits and
    # GC pauses going to the state leaves (see {#render}).
    # @param state [Symbol, String, Array<Symbol, String>, nil] one state of {#threads}
    #   (+:running+, +:waiting_for_gvl+, +:blocked+, +:gc_marking+...) or several; nil: any.
    #   (A tag named +state+ is reached through {#group_by} or {#tagged}.)
    # @param thread [Integer, Array<Integer>, nil] one thread's index in {#threads} or several
    #   (+select(thread: 0).functions+ is what the first thread ran); nil: every thread
    # @param tags [Hash{Symbol => Object}]
    # @return [RubySpy::Profile]
    # @raise [ArgumentError] for a state that does not exist, naming those that do, or a
    #   thread index out of range
    # @example
    #   profile.select(request_id: "abc").write("abc.svg", format: :flamegraph)
    #   profile.select(state: :running).functions.first
    def select(state: nil, thread: nil, **tags)
      native = state.nil? ? @native : @native.select_states(Array(state).map(&:to_s))
      native = native.select_threads(Array(thread).map { |i| Integer(i) }) unless thread.nil?
      native = native.select_tags(tags.map { |k, v| [label_name(k), v.to_s] }) unless tags.empty?
      Profile.new(native)
    end

    # The labels a sample gets from its thread's OpenTelemetry trace (RubySpy::OTel), under
    # the names Datadog's profiler gives them, reachable as Ruby keywords too:
    # +select(trace_id: ...)+ selects on "trace id".
    TRACE_LABELS = { trace_id: "trace id", span_id: "span id", local_root_span_id: "local root span id",
                     trace_endpoint: "trace endpoint" }.freeze

    # The samples that carry tag +key+, whatever its value.
    # @param key [Symbol, String]
    # @return [RubySpy::Profile]
    def tagged(key)
      Profile.new(@native.having_tag(label_name(key)))
    end

    # The same samples, each with tag +key+ = +value+ unless it carries +key+ already: the
    # RSpec integration names its example on every thread of a per-example profile.
    # @param key [Symbol, String]
    # @param value [Object] compared as text, like every tag value
    # @return [RubySpy::Profile]
    def with_tag(key, value)
      Profile.new(@native.with_tag(key.to_s, value.to_s))
    end

    # The samples split by the value of one tag.
    # @param key [Symbol, String]
    # @return [Hash{String, nil => RubySpy::Profile}] nil collects the samples without the tag
    def group_by(key)
      @native.group_by_tag(label_name(key)).transform_values { |native| Profile.new(native) }
    end

    # Every distinct stack and how many samples it had.
    # @return [Array<Hash>] +{frames: [RubySpy::Frame] (innermost first), samples: Integer,
    #   state: String, thread: Integer (index into #threads)}+
    def stacks
      frames = @native.frames.map { |row| Frame.from_row(row) }
      @native.stacks.map { |stack| stack.merge(frames: stack[:frames].map { |i| frames[i] }) }
    end

    # Functions by samples: +self+ counts the samples with the function on top of the stack,
    # +total+ those with it anywhere in the stack (once per sample, however deep it recurses).
    # A function is a label and a path, counted as the summary, pprof and callgrind count it
    # (one key, in the extension); a C function has no path of its own (its frames carry their
    # caller's), so it is one function whoever calls it, with path "". Waits for the GVL and
    # GC pauses are rows of their own, the state leaves of {#render} (+[waiting for GVL]+,
    # +[GC marking]+...: +state_leaf: true+, path ""), unless +state_leaves: false+.
    # @param limit [Integer, nil] keep only the first +limit+
    # @param idle [Boolean] false to count only the samples of threads that were not blocked
    # @param state_leaves [Boolean] false: bill waits and GC to the frame they stood in
    # @return [Array<Hash>] +{label:, path:, line:, self:, total:, state_leaf:}+ (+line+: where
    #   its frames were seen most), most self samples first (then most total)
    def functions(limit: nil, idle: true, state_leaves: true)
      rows = @native.functions(idle ? true : false, state_leaves ? true : false)
      limit ? rows.first(limit) : rows
    end

    # The share of samples whose stack passes through +function+.
    # @param function [String, Regexp] a label as {RubySpy::Frame#label} prints it
    #   (+"JSON.parse"+, +"Foo#bar"+), a base label (+"bar"+), or a Regexp matched against labels
    # @return [Float] between 0.0 and 1.0; 0.0 for a profile without samples
    # @raise [TypeError] for anything but a String or a Regexp
    def share(function)
      match = case function
              when Regexp then ->(f) { function.match?(f.label) }
              when String then ->(f) { f.label == function || f.base_label == function }
              else raise TypeError, "function must be a String or a Regexp, got #{function.class}"
              end
      total = 0
      hits = 0
      stacks.each do |stack|
        total += stack[:samples]
        hits += stack[:samples] if stack[:frames].any?(&match)
      end
      total.zero? ? 0.0 : hits.fdiv(total)
    end

    # A text summary: the top functions by self and total samples.
    # @return [String]
    def to_s
      render(:summary)
    end

    # @return [String]
    def inspect
      "#<RubySpy::Profile pid=#{pid} samples=#{samples} duration=#{format("%.2f", duration)}s>"
    end

    private

    # A tag's name, or a trace label's (TRACE_LABELS) for its keyword.
    def label_name(key)
      TRACE_LABELS.fetch(key.to_sym, key).to_s
    end
  end
end
