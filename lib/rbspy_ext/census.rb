# frozen_string_literal: true

module RubySpy
  # What fills a process's memory: its live objects by class and built-in type, read from
  # its GC's heap pages without stopping it ({RubySpy.heap}, +rubyspy heap+). A census stays
  # the extension's own data: its rows, {#render} and {#-} (which classes grew since an
  # earlier one) read it there; JSON is only what {#save} writes and {.load} reads.
  class Census
    # @api private
    # @param native [RubySpy::NativeCensus] the census the extension took or read
    def initialize(native)
      @native = native
    end

    # A census from the JSON {#save} writes (or +rubyspy heap --output x.json+).
    #
    # @param json [String]
    # @return [RubySpy::Census]
    # @raise [RubySpy::InvalidCensus] if it is not one, saying what is wrong with it
    def self.from_json(json)
      new(NativeCensus.from_json(String(json)))
    end

    # Reads a census saved by {#save} (or +rubyspy heap --output+).
    #
    # @param path [String]
    # @return [RubySpy::Census]
    # @raise [RubySpy::InvalidCensus] if the file is not one
    # @raise [SystemCallError] if it cannot be read
    def self.load(path)
      from_json(File.read(path))
    rescue InvalidCensus => e
      raise InvalidCensus, "#{path}: #{e.message}"
    end

    # Live objects by class and type, most bytes first.
    #
    # @return [Array<Hash>] one per class and type: +:name+ (the path of the objects' class
    #   as their +Kernel#class+ gives it: +Module#name+, "Class" for classes, +#<Class:0x...>+
    #   for an anonymous class; "" for what +ObjectSpace.each_object+ does not yield: hidden
    #   objects, which have no class, iclasses, imemos, and the metaclasses Ruby hides, the
    #   +T_CLASS+ row rendered "(singleton classes)"), +:type+ (+"T_OBJECT"+, +"T_STRING"+...), +:objects+, +:bytes+ (slot
    #   and outside bytes together, as +ObjectSpace.memsize_of+ sums them), +:slot_bytes+
    #   and +:heap_bytes+ (outside the slot)
    def classes
      @classes ||= @native.classes.freeze
    end

    # Live objects by built-in type alone: the sum of {#classes} per +:type+ (+:name+ is "").
    #
    # @return [Array<Hash>] as {#classes}
    def types
      @types ||= @native.types.freeze
    end

    # The row of one class (of one type, when a name has several).
    #
    # @param name [String, Module] a class path, or the class itself
    # @return [Hash, nil] as in {#classes}
    def [](name)
      name = name.name if name.is_a?(Module)
      classes.find { |row| row[:name] == name }
    end

    # @return [Integer] live objects
    def objects
      figures[:live_slots]
    end

    # Slots and pages: +:total_slots+, +:free_slots+, +:live_slots+, +:zombie_slots+
    # (awaiting finalizers), +:moved_slots+ (left by compaction), +:garbage_slots+ (not yet
    # freed by a lazy sweep), +:pages+, +:heap_bytes_total+, +:unreadable_pages+.
    #
    # @return [Hash{Symbol => Integer}]
    def slots
      figures.slice(:total_slots, :free_slots, :live_slots, :zombie_slots, :moved_slots, :garbage_slots,
                  :pages, :heap_bytes_total, :unreadable_pages, :unreadable_tables)
    end

    # @return [Boolean] true when the census stopped at +max_bytes+ before the last page
    def partial?
      figures[:partial]
    end

    # @return [Integer] passes taken again because a compaction moved objects while they
    #   were read
    def compactions
      figures.fetch(:compactions, 0)
    end

    # @return [Boolean] true when compactions kept moving objects through every pass: the
    #   counts may then include objects seen before and after they moved, or miss some
    def moving?
      figures.fetch(:moving, false)
    end

    # Each Ractor's heap, where each Ractor owns one (Ruby master of 2026-08 and later): the
    # census counts them all, where the target's own +ObjectSpace.count_objects+ and
    # +each_object+ see only the calling Ractor's.
    #
    # @return [Array<Hash>] one per heap, the main Ractor's first: +:id+ and +:name+ of its
    #   Ractor (+nil+ where unknown), +:state+ (+"running"+, +"creating"+ for a child not
    #   started yet, +"terminated"+ for a heap awaiting absorption by a living one),
    #   +:pages+, +:total_slots+, +:free_slots+, +:objects+, +:bytes+, +:slot_bytes+ and
    #   +:heap_bytes+ as in {#classes}; empty where the VM has one heap
    def ractors
      @ractors ||= @native.ractors.freeze
    end

    # @return [Boolean] true when a Ractor started or ended through every pass: a heap may
    #   then be missing from the counts, or counted twice
    def heaps_changed?
      figures.fetch(:heaps_changed, false)
    end

    # @return [Boolean] true when every pass read the page list while the GC freed pages:
    #   pages at its end, and their objects, may then be missing from the counts
    def pages_changed?
      figures.fetch(:pages_changed, false)
    end

    # @return [Integer] the process the census is of
    def pid
      figures[:pid]
    end

    # @return [String] its Ruby version
    def ruby_version
      figures[:ruby_version]
    end

    # @return [Float] seconds the census took
    def duration
      figures[:duration_us] / 1e6
    end

    # @return [Integer] bytes read from the process
    def bytes_read
      figures[:bytes_read]
    end

    # @return [String] what the bytes leave out
    def not_counted
      figures[:not_counted]
    end

    # The classes that changed since +earlier+: those that grew first, most bytes first.
    #
    # @param earlier [RubySpy::Census]
    # @return [Array<Hash>] +:name+, +:type+, +:objects+ and +:bytes+ (the changes), and
    #   +:objects_now+, +:bytes_now+
    # @raise [TypeError] unless +earlier+ is a census
    def -(other)
      raise TypeError, "can only subtract a RubySpy::Census, not #{other.class}" unless other.is_a?(Census)

      @native.diff(other.native)
    end

    # The changes since +earlier+ as text: the +limit+ classes that grew most, then shrank.
    #
    # @param earlier [RubySpy::Census]
    # @param limit [Integer]
    # @return [String]
    def diff_text(earlier, limit: 20)
      raise TypeError, "can only compare with a RubySpy::Census, not #{earlier.class}" unless earlier.is_a?(Census)

      @native.diff_text(earlier.native, Integer(limit))
    end

    # The census in a format: +:text+ (the top +limit+ classes), +:json+ (what {.load}
    # reads), or +:pprof+ (gzipped protobuf in Go's heap profile shape: +inuse_objects+ and
    # +inuse_space+, each class a sample under its type).
    #
    # @param format [Symbol] +:text+, +:json+ or +:pprof+
    # @param limit [Integer] rows of +:text+
    # @return [String] (binary for +:pprof+)
    # @raise [ArgumentError] for another format
    def render(format = :text, limit: 30)
      case format.to_sym
      when :text then text(Integer(limit))
      when :json then @native.to_json
      when :pprof then @native.pprof
      else raise ArgumentError, "unknown census format #{format.inspect}: use :text, :json or :pprof"
      end
    end

    # Live objects by class with the code that allocated them, when the census was taken
    # with +sites: true+ of a process that tracks allocations: the sampled objects the
    # process follows that are still in their slots, matched to the census's classes.
    #
    # @return [Array<Hash>, nil] one per class with sampled objects alive, most bytes first:
    #   +:name+, +:type+, +:objects+, +:bytes+ (the census's), and +:sites+, most bytes
    #   first, each +:frames+ (Array of {RubySpy::Frame}, innermost first) and the estimated
    #   +:objects+ and slot +:bytes+ still alive from it, from +:samples+ samples; nil when
    #   sites were not asked for or could not be read ({#sites_note} says why)
    def sites
      return @sites if defined?(@sites)

      @sites = @native.sites&.map do |row|
        row.merge(sites: row[:sites].map { |s| s.merge(frames: s[:frames].map { |f| Frame.from_row(f) }) })
      end.freeze
    end

    # @return [String, nil] why {#sites} is nil although sites were asked for (the process
    #   does not track allocations, or has not published yet)
    def sites_note
      @native.sites_note
    end

    # @return [Time, nil] when the process published the sites {#sites} reads (it publishes
    #   at most once a second while its allocations change, and when tracking stops)
    def sites_published_at
      figures = @native.sites_figures
      figures && Time.at(figures[3] / 1000r)
    end

    # @return [Boolean, nil] whether the process was still tracking when it published
    def sites_tracking?
      @native.sites_figures&.first
    end

    # The tracked allocations as the sites were read: what was allocated since tracking
    # started, and in use the sampled objects still in their slots. Writes Go's heap
    # profile, flame graphs and summaries as {RubySpy.allocations} does.
    #
    # @return [RubySpy::Allocations, nil] nil without {#sites}
    def allocations
      native = @native.sites_profile
      native && Allocations.new(native)
    end

    # Writes {#render}(+format+) to +path+.
    #
    # @param path [String]
    # @param format [Symbol] as {#render}
    # @return [String] path
    def save(path, format: :json)
      File.binwrite(path, render(format))
      path
    end

    # The census as text, followed by each class's top sites when it has them.
    def text(limit)
      with_sites = @native.sites_text(limit, 5)
      return with_sites if with_sites

      out = @native.text(limit)
      note = sites_note
      note ? "#{out}\nallocation sites: #{note}\n" : out
    end
    private :text

    # @return [String] the census as JSON
    def to_json(*)
      @native.to_json
    end

    # @return [Hash] every figure, as saved: {#slots}'s, +:pid+, +:ruby_version+,
    #   +:taken_at_ms+, +:duration_us+, +:bytes_read+, +:partial+, +:sweeping+,
    #   +:compactions+, +:moving+, +:heaps_changed+, +:not_counted+, and the rows
    #   (+:classes+, +:types+, +:ractors+)
    def to_h
      figures.merge(classes: classes, types: types, ractors: ractors)
    end
    alias data to_h

    # @api private
    # @return [RubySpy::NativeCensus]
    attr_reader :native
    protected :native

    # @return [String] the top classes as text
    def to_s
      render(:text)
    end

    # @return [String]
    def inspect
      "#<RubySpy::Census pid=#{pid} objects=#{objects} classes=#{classes.size}#{" partial" if partial?}>"
    end

    private

    def figures
      @figures ||= @native.figures.freeze
    end
  end
end
