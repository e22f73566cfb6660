# frozen_string_literal: true

module RubySpy
  module CLI
    # `rubyspy heap`: a census of a process's heap (RubySpy.heap) as a top list, JSON or
    # pprof; with --by site, each class's allocation sites from a process that tracks
    # allocations (text, or Go's heap profile as pprof); the classes that grew between two
    # saved censuses (--diff A B); or the top growers every N seconds (--watch N) until
    # Ctrl-C or the process's exit.
    module Heap
      FORMATS = %w[text json pprof].freeze
      BY = %w[class site].freeze

      module_function

      # Runs `rubyspy heap ARGS`.
      # @param argv [Array<String>] the arguments after `heap` (consumed)
      # @return [Integer] the exit status (0; errors raise, and RubySpy::CLI.run reports them)
      def run(argv)
        options = { format: nil, limit: 30 }
        parser = OptionParser.new do |opts|
          opts.banner = "Usage: rubyspy heap --pid PID [--by class|site] [--output FILE] [--format text|json|pprof]\n" \
                        "       rubyspy heap --diff EARLIER.json LATER.json\n" \
                        "       rubyspy heap --pid PID --watch SECONDS"
          CLI.pid_option(opts, options)
          opts.on("-o", "--output FILE", "write the census to FILE (format from its extension: .json, " \
                                         ".pb.gz/.pprof, else text)") { |v| options[:output] = v }
          opts.on("-f", "--format FORMAT", FORMATS, "text (default on a terminal), json or pprof") do |v|
            options[:format] = v
          end
          opts.on("--by WHAT", BY, "class (default), or site: each class's allocation sites, read from a " \
                                   "process that tracks allocations (RUBYSPY_ALLOCATIONS=1)") { |v| options[:by] = v }
          opts.on("-n", "--limit N", Integer, "rows of the top list (default 30)") { |v| options[:limit] = v }
          opts.on("--max-bytes BYTES", Integer, "stop after reading this many bytes of pages (a partial census)") do |v|
            options[:max_bytes] = v
          end
          opts.on("--diff", "compare two censuses saved with --output (the two files follow)") { options[:diff] = true }
          opts.on("--watch SECONDS", Float, "print the classes that grew most every SECONDS") { |v| options[:watch] = v }
          opts.on("-h", "--help") { puts opts; return 0 }
        end
        parser.parse!(argv)
        return diff(argv, options[:limit]) if options[:diff]
        raise Usage, "heap needs --pid PID (or --diff EARLIER LATER)" unless options[:pid]
        raise Usage, "--limit must be positive, got #{options[:limit]}" unless options[:limit].positive?

        handle = RubySpy.attach(options[:pid], force_version: options[:force_version])
        raise Usage, "--watch shows classes; --by site is a single look" if options[:watch] && options[:by] == "site"
        return watch(handle, options) if options[:watch]

        census = handle.heap(max_bytes: options[:max_bytes], sites: options[:by] == "site")
        return write_sites(census, options) if options[:by] == "site"

        write(census, options)
      end

      # `--by site`: the census with each class's sites as text (a note on stderr when the
      # process does not track allocations), or as pprof Go's heap profile of the tracked
      # allocations (in use: the sampled objects still alive).
      # @return [Integer] 0
      def write_sites(census, options)
        warn "rubyspy: #{census.sites_note}" if census.sites_note
        format = (options[:format] || format_of(options[:output])).to_sym
        allocations = census.allocations
        return write(census, options) unless format == :pprof && allocations

        out = allocations.pprof(opens: :heap)
        return $stdout.tap(&:binmode).write(out) && 0 unless options[:output]

        File.binwrite(options[:output], out)
        warn "rubyspy: wrote the tracked allocations of #{census.sites.size} classes (pprof, opening on " \
             "inuse_space) to #{options[:output]}"
        0
      end

      # Writes +census+ in the format asked (or the output file's extension says) to the
      # output file, or to stdout.
      # @return [Integer] 0
      def write(census, options)
        format = (options[:format] || format_of(options[:output])).to_sym
        out = census.render(format, limit: options[:limit])
        if options[:output]
          File.binwrite(options[:output], out)
          warn "rubyspy: wrote a census of #{census.objects} objects (#{format}) to #{options[:output]}"
        else
          $stdout.binmode if format == :pprof
          $stdout.write(out)
        end
        0
      end

      # The format a file name asks for: .json, .pb.gz/.pprof/.pb, else text.
      # @param path [String, nil]
      # @return [String]
      def format_of(path)
        case path
        when nil then "text"
        when /\.json\z/ then "json"
        when /\.(pb\.gz|pprof|pb)\z/ then "pprof"
        else "text"
        end
      end

      # `--diff EARLIER LATER`: the classes that grew, then shrank, between two saved censuses.
      # @param paths [Array<String>] the two files
      # @param limit [Integer] rows of each list
      # @return [Integer] 0
      def diff(paths, limit)
        raise Usage, "--diff needs two census files (EARLIER LATER), got #{paths.size}" unless paths.size == 2

        earlier, later = paths.map { |p| RubySpy::Census.load(p) }
        puts "heap of pid #{later.pid}: #{later.objects - earlier.objects} more live objects " \
             "(#{earlier.objects} -> #{later.objects})"
        puts later.diff_text(earlier, limit: limit)
        0
      end

      # `--watch SECONDS`: a census every SECONDS, printing what grew since the one before,
      # until Ctrl-C or the process's exit.
      # @return [Integer] 0
      def watch(handle, options)
        raise Usage, "--watch must be positive, got #{options[:watch]}" unless options[:watch].positive?

        earlier = handle.heap(max_bytes: options[:max_bytes])
        puts "watching the heap of pid #{handle.pid} (#{earlier.objects} live objects); Ctrl-C stops"
        loop do
          sleep options[:watch]
          now = handle.heap(max_bytes: options[:max_bytes])
          puts "--- #{Time.now.strftime("%H:%M:%S")}: #{now.objects} live objects (#{format("%+d", now.objects - earlier.objects)})"
          puts now.diff_text(earlier, limit: [options[:limit], 10].min)
          $stdout.flush
          earlier = now
        end
      rescue Interrupt
        0
      rescue RubySpy::ProcessExited
        puts "process #{handle.pid} exited"
        0
      end
    end
  end
end
