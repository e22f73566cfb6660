# frozen_string_literal: true

require "etc"
require "io/console"
require "json"
require "optparse"
require_relative "../rbspy_ext"
require_relative "cli/top"
require_relative "cli/heap"

# The `rubyspy` command (exe/rubyspy is only its entry point), here so that specs and other
# programs can run it in-process: `RubySpy::CLI.run(%w[snapshot --pid 42])` returns the exit
# status and writes to $stdout and $stderr.
module RubySpy
  # The command-line interface; see `rubyspy --help`.
  module CLI
    # A problem with the command line itself: one line and exit 2.
    class Usage < StandardError; end

    module_function

    # Runs one `rubyspy` command line.
    # @param argv [Array<String>] the arguments after `rubyspy` (consumed)
    # @return [Integer] the exit status: 0, 1 for an error reading or writing, 2 for a usage
    #   error (each printed to $stderr as one line)
    def run(argv)
      verbose = argv.delete("--verbose")
      command = argv.shift
      # Without native code every command fails the same way: say why before parsing options
      # (the formats, for one, come from the extension).
      if %w[snapshot record report tags top heap layout].include?(command) && RubySpy::Native.unsupported_reason
        raise RubySpy::UnsupportedPlatform, RubySpy::Native.unsupported_message
      end
      case command
      when "snapshot" then snapshot(argv)
      when "record" then record(argv)
      when "report" then report(argv)
      when "tags" then tags(argv)
      when "layout" then layout(argv)
      when "top" then top(argv)
      when "heap" then Heap.run(argv)
      when nil, "-h", "--help", "help" then puts(top_help) || 0
      when "-V", "--version", "version" then puts("rubyspy #{RubySpy::VERSION}") || 0
      else raise Usage, "unknown command #{command.inspect} (snapshot, record, top, heap, report, tags, layout)"
      end
    rescue Usage, OptionParser::ParseError => e
      warn "rubyspy: #{e.message}"
      2
    rescue RubySpy::Error, ArgumentError, TypeError, SystemCallError => e
      warn "rubyspy: #{e.message}"
      warn e.backtrace.join("\n") if verbose
      1
    end

    def top_help
      <<~HELP
        Usage: rubyspy COMMAND [options]   (rubyspy COMMAND --help for each)
          snapshot   print what a Ruby process is doing right now
          record     sample a process (or a command) and write a profile
          top        a live view of the functions a process spends its time in
          heap       which classes fill a process's heap (a census read from outside), and what grew
          report     render a raw profile in another format
          tags       print each thread's tags (RubySpy.tag) and where BPF programs find them
          layout     print the struct layout a process is read with, and where it came from
        Common: --verbose shows backtraces of errors; rubyspy --version prints the version.
      HELP
    end

    def pid_option(opts, options)
      opts.on("-p", "--pid PID", Integer, "the process to read") do |v|
        raise Usage, "--pid must be a positive process id, got #{v}" unless v.positive?

        options[:pid] = v
      end
      opts.on("--force-version VERSION", "read the process with this Ruby release's layout (e.g. 3.3.8), " \
                                         "for a build whose version string misleads") do |v|
        options[:force_version] = v
      end
    end

    def snapshot(argv)
      options = { threads: "gvl" }
      parser = OptionParser.new do |opts|
        opts.banner = "Usage: rubyspy snapshot --pid PID [--threads all]"
        pid_option(opts, options)
        opts.on("--threads WHICH", %w[all gvl], "all threads, or the GVL holder (default)") do |v|
          options[:threads] = v
        end
        opts.on("--json", "print JSON: the frames and tags, or with --threads all every thread") do
          options[:json] = true
        end
        opts.on("-h", "--help") { puts opts; return 0 }
      end
      parser.parse!(argv)
      raise Usage, "snapshot needs --pid PID" unless options[:pid]

      handle = RubySpy.attach(options[:pid], force_version: options[:force_version])
      return snapshot_json(handle, options[:threads] == "all") if options[:json]

      if options[:threads] == "all"
        sample = handle.thread_sample
        sample[:threads].each do |t|
          puts "#{thread_title(t)}: #{t[:state]}"
          puts "  tags: #{tag_text(t[:tags])}" unless t[:tags].empty?
          t[:frames].each { |f| puts "  #{f}" }
        end
        dropped_note(sample[:dropped])
      else
        stack = handle.snapshot
        puts "tags: #{tag_text(stack.tags)}" unless stack.tags.empty?
        puts stack
      end
      0
    end

    # `snapshot --json`: {pid, ruby_version, frames, tags}, or {pid, ruby_version, threads}
    # with each thread's tid, name, main, state, tags and frames. Frames are Frame#to_h.
    def snapshot_json(handle, all)
      doc = { pid: handle.pid, ruby_version: handle.ruby_version }
      if all
        sample = handle.thread_sample
        doc[:threads] = sample[:threads].map { |t| t.merge(frames: t[:frames].map(&:to_h)) }
        doc[:dropped] = sample[:dropped]
      else
        stack = handle.snapshot
        doc[:tags] = stack.tags
        doc[:frames] = stack.map(&:to_h)
      end
      puts JSON.generate(doc)
      0
    end

    # "Thread 123 (name) main", and " in ractor 2 (name)" for a thread of another Ractor
    # than the main one.
    def thread_title(thread)
      title = "Thread #{thread[:tid]}#{" (#{thread[:name]})" if thread[:name]}#{" main" if thread[:main]}"
      "#{title}#{" in #{RubySpy.ractor_text(thread)}" if thread[:ractor].to_i > 1}"
    end

    def tag_text(tags)
      tags.map { |k, v| "#{k}=#{v}" }.join(" ")
    end

    # The threads a sample left out, on stderr so that stdout stays the stacks.
    def dropped_note(dropped)
      return if dropped.empty?

      counts = dropped.tally.map { |reason, n| "#{n} #{reason}" }.join(", ")
      warn "#{dropped.size} threads not shown, their stacks did not read (#{counts})"
    end

    def tags(argv)
      options = {}
      parser = OptionParser.new do |opts|
        opts.banner = "Usage: rubyspy tags --pid PID"
        pid_option(opts, options)
        opts.on("-h", "--help") { puts opts; return 0 }
      end
      parser.parse!(argv)
      raise Usage, "tags needs --pid PID" unless options[:pid]

      handle = RubySpy.attach(options[:pid], force_version: options[:force_version])
      offset = handle.profiler_state_offset
      unless offset
        puts "process #{options[:pid]} has not loaded rbspy_ext: no ruby_profiler_state to read"
        return 0
      end
      puts "ruby_profiler_state_tp_offset: #{offset} (see docs/profiler-state.md)"
      handle.thread_snapshots.each do |t|
        puts "#{thread_title(t)}: #{t[:tags].empty? ? "(no tags)" : tag_text(t[:tags])}"
      end
      0
    end

    # `rubyspy layout --pid PID`: where the layout came from (its debug information or a
    # table), whether the table agrees, then every field.
    def layout(argv)
      options = {}
      parser = OptionParser.new do |opts|
        opts.banner = "Usage: rubyspy layout --pid PID"
        pid_option(opts, options)
        opts.on("-h", "--help") { puts opts; return 0 }
      end
      parser.parse!(argv)
      raise Usage, "layout needs --pid PID" unless options[:pid]

      layout = RubySpy.attach(options[:pid], force_version: options[:force_version]).layout
      puts layout[:lines]
      layout[:fields].each { |name, value| puts "#{name} #{value.nil? ? "none" : value.inspect}" }
      0
    end

    def top(argv)
      options = { rate: 99, idle: false, state_leaves: true }
      parser = OptionParser.new do |opts|
        opts.banner = "Usage: rubyspy top --pid PID [options]   (keys: 1-4 sort, q quits)"
        pid_option(opts, options)
        opts.on("-r", "--rate HZ", Float, "samples per second (default 99)") { |v| options[:rate] = v }
        opts.on("--idle", "count the samples of blocked threads too") { options[:idle] = true }
        opts.on("--no-state-leaves", "no [waiting for GVL] / [GC ...] rows: waits and GC billed to the " \
                                     "function they stood in") { options[:state_leaves] = false }
        opts.on("-h", "--help") { puts opts; return 0 }
      end
      parser.parse!(argv)
      raise Usage, "unexpected arguments: #{argv.join(" ")}" unless argv.empty?
      raise Usage, "top needs --pid PID" unless options[:pid]
      raise Usage, "--rate must be a rate in Hz up to #{RubySpy::MAX_RATE.to_i}" unless RubySpy.valid_rate?(options[:rate])

      Top.new(options[:pid], rate: options[:rate], idle: options[:idle], state_leaves: options[:state_leaves],
                             force_version: options[:force_version]).run
    end

    def record(argv)
      command = (i = argv.index("--")) ? argv.slice!(i..)[1..] : nil
      options = { rate: 99, formats: [], threads: :all, on_cpu: false, view: {}, drop_root: true }
      parser = OptionParser.new do |opts|
        opts.banner = "Usage: rubyspy record (--pid PID | -- COMMAND ARGS...) [options]"
        pid_option(opts, options)
        opts.on("-r", "--rate HZ", Float, "samples per second (default 99)") { |v| options[:rate] = v }
        opts.on("-d", "--duration SECONDS", Float, "stop after this long") { |v| options[:duration] = v }
        format_options(opts, options, "flamegraph")
        opts.on("-o", "--output PATH", "where to write (default rubyspy-PID-TIME.EXT); with several " \
                                      "formats, PATH.EXT for each") { |v| options[:output] = v }
        opts.on("--raw PATH", "also keep the raw profile (for rubyspy report) at PATH") { |v| options[:raw] = v }
        opts.on("--threads WHICH", %w[all gvl], "all threads (default) or the GVL holder") do |v|
          options[:threads] = v.to_sym
        end
        opts.on("--on-cpu", "keep only samples of threads holding the GVL") { options[:on_cpu] = true }
        opts.on("--bpf", "sample in the kernel (BPF): threads on a CPU, no wake-up per sample; " \
                         "needs root or CAP_BPF+CAP_PERFMON") { options[:mode] = :bpf }
        view_options(opts, options)
        opts.on("--subprocesses", "also record Ruby child processes") { options[:subprocesses] = true }
        opts.on("--no-drop-root", "run COMMAND as root even under sudo (default: as SUDO_UID/SUDO_GID)") do
          options[:drop_root] = false
        end
        opts.on("-h", "--help") { puts opts; return 0 }
      end
      parser.parse!(argv)
      raise Usage, "unexpected arguments: #{argv.join(" ")}" unless argv.empty?
      raise Usage, "record needs --pid PID or -- COMMAND" unless options[:pid] || command
      raise Usage, "give either --pid or a command, not both" if options[:pid] && command

      formats = options[:formats].empty? ? ["flamegraph"] : options[:formats].uniq
      check_view(formats, options[:view])
      # Everything that can be checked is checked before a command is started.
      check_writable(options[:output]) if options[:output]
      check_writable(options[:raw]) if options[:raw]
      record_options = { rate: options[:rate], duration: options[:duration],
                         threads: options[:threads], on_cpu: options[:on_cpu],
                         subprocesses: options[:subprocesses] ? true : false,
                         force_version: options[:force_version], mode: options[:mode] || :user }
      begin
        RecordOptions.new(**record_options)
      rescue ArgumentError, TypeError => e
        raise Usage, e.message
      end
      user = invoking_user if options[:drop_root]
      pid = options[:pid] || spawn_ruby(command, options[:force_version], user)
      paths = output_paths(formats, options[:output], "rubyspy-#{pid}-#{Time.now.strftime("%Y%m%d-%H%M%S")}")
      paths.each_value { |path| check_writable(path) }
      recorder = Recorder.new(pid, **record_options).start
      interrupted = false
      trap("INT") { interrupted = true }
      show = $stderr.tty?
      shown = 0
      until interrupted || !recorder.running?
        sleep 0.25
        shown = live_display(pid, recorder.progress, shown) if show
      end
      profile = recorder.stop
      stopped = true
      write_outputs(profile, paths, options[:view], options[:raw])
      profile.notes.each { |n| warn "rubyspy: #{n}" }
      warn "rubyspy: #{kernel_cost(profile.cost)}" if profile.cost[:bpf_runs]
      warn "rubyspy: wrote #{profile.samples} samples to #{[*paths.values, *options[:raw]].join(", ")}"
      0
    ensure
      if command && pid
        begin
          # A command that will not be recorded (interrupted, or an error after it started,
          # such as an output path that cannot be written) is stopped, not waited for.
          Process.kill(:TERM, pid) if interrupted || !stopped
          Process.wait(pid)
        rescue SystemCallError
          nil
        end
      end
    end

    # What a BPF recording cost, per sample kept.
    def kernel_cost(cost)
      format("cost per sample: %<kernel>.2f us in the kernel (BPF), %<user>.2f us in the recorder; " \
             "%<wakeups>d wake-ups", kernel: cost[:bpf_per_tick_us], user: cost[:per_tick_us],
                                     wakeups: cost[:wakeups])
    end

    # -f/--format, which may be given more than once.
    def format_options(opts, options, default)
      opts.on("-f", "--format NAME", Profile::FORMATS.map(&:to_s),
              "#{Profile::FORMATS.join(", ")} (default #{default}); repeat for several") do |v|
        options[:formats] << v
      end
    end

    # The flags of Profile#render's view keywords, by keyword.
    VIEW_FLAGS = { per_thread: "--per-thread", lines: "--lines", idle: "--idle", state: "--state",
                   tag: "--by-tag" }.freeze
    # The keywords every format takes (the others: Profile::VIEW_FORMATS only).
    EVERY_FORMAT = %i[state_leaves].freeze

    def view_options(opts, options)
      view = options[:view]
      opts.separator "How flamegraph, speedscope and collapsed show stacks (default: every thread's " \
                     "functions merged, blocked threads left out):"
      opts.on("--per-thread", "a root per thread (speedscope: a profile per thread)") { view[:per_thread] = true }
      opts.on("--lines", "a frame per line executing, not per function") { view[:lines] = true }
      opts.on("--idle", "keep the samples of blocked threads (sleep, IO, locks)") { view[:idle] = true }
      opts.on("--state", "a root per thread state (running, waiting_for_gvl, blocked, gc_*, no_gvl with --bpf)") { view[:state] = true }
      opts.on("--by-tag KEY", "a root per value of this tag (speedscope: a profile per value)") { |v| view[:tag] = v }
      opts.on("--no-state-leaves", "every format: no [waiting for GVL] / [GC ...] leaves; waits and GC " \
                                   "billed to the frame they stood in") { view[:state_leaves] = false }
    end

    # A view flag needs a format that takes it: an error before anything runs, not after.
    def check_view(formats, view)
      shaping = view.except(*EVERY_FORMAT)
      return if shaping.empty? || formats.any? { |f| Profile::VIEW_FORMATS.include?(f.to_sym) }

      flag = VIEW_FLAGS.fetch(shaping.keys.first)
      raise Usage, "#{flag} applies to #{Profile::VIEW_FORMATS.join(", ")} only, not to #{formats.join(", ")}"
    end

    # Format => path: one format goes to +output+ itself, several to +output+ (or
    # +default_base+) followed by each format's extension.
    def output_paths(formats, output, default_base)
      return { formats.first => output } if output && formats.size == 1

      base = output || default_base
      formats.to_h { |f| [f, "#{base}.#{Profile::EXTENSIONS.fetch(f.to_sym)}"] }
    end

    # Writes each format (the raw profile first: it keeps everything whatever happens next),
    # giving the view keywords to the formats that take them.
    def write_outputs(profile, paths, view, raw)
      profile.write(raw, format: :raw) if raw
      shaped = paths.keys.select { |f| Profile::VIEW_FORMATS.include?(f.to_sym) }
      tell_idle(profile, shaped, view)
      paths.each do |format, path|
        keywords = shaped.include?(format) ? view : view.slice(*EVERY_FORMAT)
        profile.write(path, format: format, **keywords)
      end
    end

    # Says how many idle samples the view formats +shaped+ leave out (collapsed has nowhere to
    # say it; a profile of idle samples only keeps them).
    def tell_idle(profile, shaped, view)
      blocked = profile.samples_in(:blocked)
      return if view[:idle] || blocked.zero? || blocked == profile.samples || shaped.empty?

      warn "rubyspy: #{blocked} idle samples (blocked threads) left out of #{shaped.join(", ")}; --idle shows them"
    end

    # The user sudo ran rubyspy for (SUDO_UID, SUDO_GID), when running as root: a command
    # recorded runs as them, as rbspy does, rather than as root.
    def invoking_user
      return nil unless Process.euid.zero?

      uid = Integer(ENV.fetch("SUDO_UID", ""), exception: false)
      gid = Integer(ENV.fetch("SUDO_GID", ""), exception: false)
      uid&.positive? && gid ? [uid, gid] : nil
    end

    # Redraws the terminal status: elapsed time, samples and the live top 10 (functions most
    # often on top of a stack). Returns the number of lines drawn.
    def live_display(pid, progress, previous_lines)
      lines = [format("recording pid %d: %.1f s, %d samples (Ctrl-C stops and writes)",
                      pid, progress[:elapsed], progress[:samples])]
      total = [progress[:samples], 1].max
      progress[:top].each do |label, n|
        lines << format("  %5.1f%%  %s", 100.0 * n / total, label)
      end
      # A line wider than the terminal wraps, and moving up previous_lines would then leave
      # its tail behind: every line is cut to the width.
      width = ($stderr.winsize[1] rescue 80)
      lines = lines.map { |l| l.size < width ? l : "#{l[0, width - 2]}…" }
      $stderr.print("\e[#{previous_lines}A") if previous_lines.positive?
      $stderr.print(lines.map { |l| "\e[2K#{l}\n" }.join)
      lines.size
    end

    # Starts a command (as +user+, [uid, gid], when given) and waits (up to 10 s) until its
    # Ruby VM can be read: while it execs (a wrapper script) or Ruby boots, attaching fails in
    # passing ways.
    def spawn_ruby(command, force_version, user = nil)
      pid = user ? spawn_as(command, *user) : Process.spawn(*command)
      deadline = Process.clock_gettime(Process::CLOCK_MONOTONIC) + 10
      begin
        RubySpy.attach(pid, force_version: force_version)
      rescue RubySpy::NotRubyProcess, RubySpy::NoSuchProcess, RubySpy::CorruptMemory,
             RubySpy::StackChanged
        raise if Process.clock_gettime(Process::CLOCK_MONOTONIC) > deadline || Process.wait(pid, Process::WNOHANG)

        sleep 0.01
        retry
      end
      pid
    end

    # Process.spawn has no uid option: fork, give up root for good, exec.
    # The user's supplementary groups (initgroups) and HOME, USER and LOGNAME come along, as
    # sudo -u would give them, when the uid has a passwd entry. Returns once the child has
    # exec'd (or failed to): before that it is a copy of this Ruby, which attaching would
    # take for the command's (the pipe's write end closes on exec).
    def spawn_as(command, uid, gid)
      user = begin
        Etc.getpwuid(uid)
      rescue ArgumentError
        nil
      end
      reader, writer = IO.pipe
      pid = fork do
        reader.close
        user ? Process.initgroups(user.name, gid) : Process.groups = [gid]
        Process::GID.change_privilege(gid)
        Process::UID.change_privilege(uid)
        env = user ? { "HOME" => user.dir, "USER" => user.name, "LOGNAME" => user.name } : {}
        exec(env, *command)
      # Any failure ends the child here, never in this process's at_exit handlers, and
      # tells the parent why through the pipe.
      rescue Exception => e # rubocop:disable Lint/RescueException
        writer.write("cannot run #{command.first} as uid #{uid}: #{e.message}") rescue nil
        exit!(127)
      end
      writer.close
      # EOF at the exec, or after the message of a child that could not exec; bounded, since
      # a stuck name service (initgroups) must not hang rubyspy.
      if IO.select([reader], nil, nil, 10)
        failure = reader.read
        return pid if failure.empty?

        # The one error to report: the child is gone, and attaching would only add "no
        # process with pid N".
        Process.wait(pid)
        raise RubySpy::Error, failure
      end

      Process.kill(:KILL, pid)
      Process.wait(pid)
      raise RubySpy::Error, "#{command.first} did not start as uid #{uid} within 10 s (initgroups or exec hung)"
    ensure
      reader&.close
      writer&.close unless writer&.closed?
    end

    def check_writable(path)
      return if File.exist?(path) && !File.directory?(path) && File.writable?(path) # /dev/null, or a file to replace

      dir = File.dirname(File.expand_path(path))
      raise Usage, "cannot write #{path}: #{dir} is not a writable directory" unless File.directory?(dir) && File.writable?(dir)
    end

    def report(argv)
      options = { formats: [], view: {} }
      parser = OptionParser.new do |opts|
        opts.banner = "Usage: rubyspy report --input RAW [--format NAME]... [--output PATH] [options]"
        opts.on("--input PATH", "a profile written with --format raw or --raw") { |v| options[:input] = v }
        format_options(opts, options, "summary")
        opts.on("-o", "--output PATH", "default: standard output (one format); with several formats, " \
                                      "PATH.EXT for each") { |v| options[:output] = v }
        view_options(opts, options)
        opts.on("-h", "--help") { puts opts; return 0 }
      end
      parser.parse!(argv)
      raise Usage, "unexpected arguments: #{argv.join(" ")}" unless argv.empty?
      raise Usage, "report needs --input RAW" unless options[:input]

      formats = options[:formats].empty? ? ["summary"] : options[:formats].uniq
      check_view(formats, options[:view])
      raise Usage, "several formats need --output (a base name)" if formats.size > 1 && !options[:output]

      profile = Profile.load(options[:input])
      if options[:output]
        paths = output_paths(formats, options[:output], nil)
        paths.each_value { |path| check_writable(path) }
        write_outputs(profile, paths, options[:view], nil)
      else
        format = formats.first
        shaped = Profile::VIEW_FORMATS.include?(format.to_sym)
        tell_idle(profile, [format], options[:view]) if shaped
        keywords = shaped ? options[:view] : options[:view].slice(*EVERY_FORMAT)
        $stdout.binmode.write(profile.render(format, **keywords))
      end
      0
    end

    # Only #run is the interface; the rest are its steps (module functions, so that they
    # call each other plainly).
    private_class_method :top_help, :snapshot, :snapshot_json, :tag_text, :tags, :top,
                         :record, :format_options, :view_options, :check_view, :output_paths,
                         :write_outputs, :tell_idle, :invoking_user, :live_display, :spawn_ruby,
                         :spawn_as, :check_writable, :report
  end
end
