# frozen_string_literal: true

require "forwardable"

module RubySpy
  # The frames of one thread, innermost first (an Array of {RubySpy::Frame}), with the tags
  # of the fiber the thread was running.
  class Stack < Array
    # @return [Hash{Symbol => String}] the tags ({RubySpy.tag} in the target) as text:
    #   Strings, Symbols, Integers, Floats, true/false/nil as themselves, other objects as
    #   their class name; empty when there are none or the target has not loaded rbspy_ext
    attr_reader :tags

    # @api private
    def initialize(frames, tags)
      super(frames)
      @tags = tags.freeze
    end

    # @api private
    def self.tags_from(pairs)
      pairs.to_h { |k, v| [k.to_sym, v] }
    end
  end

  # A live view of one Ruby process, opened by {RubySpy.attach}. It finds the Ruby VM once
  # and caches what cannot change, so each {#snapshot} costs a few memory reads. A handle is
  # safe to share between threads (snapshots through it are serialised).
  class Handle
    # @param pid [Integer] the process to read; +Process.pid+ for the calling process
    # @param force_version [String, nil] use this Ruby version's struct layout instead of
    #   the version the process reports (for builds whose version string is misleading)
    # @raise [TypeError] if +pid+ is not an Integer
    # @raise [ArgumentError] if +pid+ is not positive
    # @raise [RubySpy::Error] a subclass naming why the process cannot be read
    def initialize(pid, force_version: nil)
      @native = NativeHandle.open(pid, force_version)
      @frames = []
      @lock = Mutex.new
    end

    # The stack of the thread holding the GVL (the main thread when none holds it),
    # innermost frame first.
    #
    # @return [RubySpy::Stack] the frames (an Array of {RubySpy::Frame}), with the tags of
    #   the fiber that thread was running ({RubySpy.tag} in the target)
    # @raise [RubySpy::ProcessExited] if the process has gone
    # @raise [RubySpy::StackChanged] if the stack kept changing during several attempts
    def snapshot
      # Frames are immutable, so each distinct one is built once and reused (see
      # ext/rbspy_ext/src/handle.rs); the lock keeps ids and their definitions together.
      @lock.synchronize do
        read = @native.snapshot_ids
        read[:fresh].each { |id, row| @frames[id] = Frame.from_row(row) }
        Stack.new(read[:ids].map { |id| @frames[id] }, Stack.tags_from(read[:tags]))
      end
    end

    # Every Ruby thread of the process, in every Ractor, with its state and stack.
    #
    # @return [Array<Hash>] one per thread: +:tid+ (native thread id, 0 when the Ruby
    #   version does not record it), +:name+, +:main+, +:ractor+ (its Ractor's id: 1 for the
    #   main Ractor, 0 before Ruby 3.0), +:ractor_name+ (nil unless given), +:state+
    #   ("running" or "waiting_for_gvl" by its own Ractor's GVL, "blocked", "gc_marking"...),
    #   +:frames+ (Array of {RubySpy::Frame}),
    #   +:tags+ (the tags of the fiber it was running, Hash{Symbol => String})
    def thread_snapshots
      thread_sample[:threads]
    end

    # One sample of every Ruby thread of the process, as {#thread_snapshots} gives them, with
    # the threads it could not read.
    #
    # @return [Hash] +:threads+ (what {#thread_snapshots} returns) and +:dropped+ (Array of
    #   String, one reason per thread whose stack kept moving while read, e.g. "stack changed
    #   while read": such a thread is left out rather than shown with a wrong stack)
    def thread_sample
      sample = @lock.synchronize { @native.thread_sample }
      threads = sample[:threads].map do |t|
        t.merge(frames: t[:frames].map { |row| Frame.from_row(row) }, tags: Stack.tags_from(t[:tags]))
      end
      { threads: threads, dropped: sample[:dropped] }
    end

    # A census of the process's heap: its live objects by class and type, read from its GC's
    # pages while it runs (see {RubySpy.heap}).
    #
    # @param max_bytes [Integer, nil] stop before reading more than this many bytes of pages;
    #   the census is then {Census#partial? partial}
    # @param sites [Boolean] also read the allocation sites the process publishes while it
    #   tracks allocations, and join them with the census ({Census#sites})
    # @return [RubySpy::Census]
    # @raise [ArgumentError] if +max_bytes+ is not a positive Integer
    # @raise [RubySpy::Error] a subclass naming why the heap cannot be read
    def heap(max_bytes: nil, sites: false)
      unless max_bytes.nil? || (max_bytes.is_a?(Integer) && max_bytes.positive?)
        raise ArgumentError, "max_bytes: must be a positive Integer (bytes) or nil, got #{max_bytes.inspect}"
      end

      Census.new(@lock.synchronize { @native.census(max_bytes, sites ? true : false) })
    end

    extend Forwardable
    # @!method pid
    #   @return [Integer] the process this handle reads
    # @!method ruby_version
    #   @return [String] the Ruby version the process reports, e.g. "3.1.2"
    # @!method warning
    #   @return [String, nil] set when the struct layout came from another patch release
    # @!method read_calls
    #   @return [Integer] how many +process_vm_readv+ calls this handle has made
    # @!method profiler_state_offset
    #   @return [Integer, nil] the offset of +ruby_profiler_state+ from a thread pointer in
    #     this process (its +ruby_profiler_state_tp_offset+), nil if it has not loaded
    #     rbspy_ext; what a BPF program needs (docs/profiler-state.md)
    # @!method layout
    #   Where the struct layout this handle reads with came from, and its fields.
    #   @return [Hash] +:source+ (+:debug_info+, the target's own DWARF, or +:table+, this
    #     build's table), +:lines+ (what +rubyspy layout+ prints first: +"source: debug info
    #     PATH (build-id HEX)"+ or +"source: table NAME"+, then +"table NAME agrees"+ or
    #     +"table NAME differs: FIELD, ..."+), +:table+ (the table's layout of the same
    #     release, nil if none), and for debug info +:path+, +:build_id+, +:cached+ and
    #     +:differs+ (the fields where the table's layout differs, which the DWARF's wins
    #     over), for a table +:unusable+ (why the debug information was not used, if any);
    #     +:fields+ maps each field to its value (an Integer, nil, or a pair)
    #   @example
    #     RubySpy.attach(pid).layout[:lines] #=> ["source: debug info /usr/local/bin/ruby (build-id 4f...)", "table 3.4 agrees"]
    def_delegators :@native, :pid, :ruby_version, :warning, :read_calls, :profiler_state_offset, :layout
  end
end
