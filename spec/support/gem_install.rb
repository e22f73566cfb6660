# frozen_string_literal: true

require "fileutils"
require "json"
require "rbconfig"
require_relative "helpers/waiting"

module RubySpyTest
  # Installing the packed gems as users do, in fresh GEM_HOMEs, on the host Ruby or inside a
  # script/rubies chroot, and checking the installed copy against a live process.
  module GemInstall
    module_function

    def monotonic
      Process.clock_gettime(Process::CLOCK_MONOTONIC)
    end

    # Runs +cmd+ with its output in +log+, killing its process group after +timeout+ seconds.
    # @return [Array(Process::Status, String)]
    def run(cmd, log:, timeout:, env: {}, chdir: "/")
      env = { "PATH" => "/usr/sbin:/usr/bin:/sbin:/bin" }.merge(env)
      pid = Process.spawn(env, *cmd, chdir: chdir, in: File::NULL, out: log, err: %i[child out],
                                     pgroup: true, unsetenv_others: true)
      status = Waiting.wait_for(cmd.join(" "), timeout: timeout, interval: 0.05, raise_on_timeout: false) do
        Process.waitpid2(pid, Process::WNOHANG)&.last
      end
      unless status
        Process.kill("KILL", -pid)
        Process.wait(pid)
        raise "#{cmd.join(' ')} timed out after #{timeout}s:\n#{File.read(log)}"
      end
      [status, File.read(log)]
    end

    # A target that writes its main thread's backtrace_locations (the ground truth) to ARGV[0]
    # once that thread sleeps in +nap+, then sleeps on. Plain Ruby 2.7.
    TARGET = <<~'RUBY'
      require "json"
      def nap
        sleep
      end

      def outer
        nap
      end

      Thread.new do
        Thread.pass until Thread.main.status == "sleep"
        frames = Thread.main.backtrace_locations.map do |l|
          { label: l.label, base_label: l.base_label, path: l.path,
            absolute_path: l.absolute_path, lineno: l.lineno }
        end
        File.write("#{ARGV[0]}.tmp", JSON.generate(frames))
        File.rename("#{ARGV[0]}.tmp", ARGV[0])
      end
      outer
    RUBY

    # Snapshots process ARGV[0] through whatever rbspy_ext `require` finds, and prints JSON:
    # what got loaded, the frames, or the error. The ground truth is written after the target
    # sleeps, so the first snapshot already sees it asleep; StackChanged is retried.
    CHECKER = <<~'RUBY'
      require "json"
      out = {}
      begin
        require "rbspy_ext"
        out["features"] = $LOADED_FEATURES.grep(/rbspy_ext/)
        tries = 0
        begin
          out["frames"] = RubySpy.snapshot(Integer(ARGV[0])).map(&:to_h)
        rescue RubySpy::StackChanged
          retry if (tries += 1) < 20
          raise
        end
      rescue Exception => e # report any failure (a LoadError too) as data
        out["error"] = "#{e.class}: #{e.message}"
      end
      puts JSON.generate(out)
    RUBY

    # Where a gem gets installed: the host's Ruby, or a chroot's run inside it (with /proc
    # mounted in a private namespace, as a container has it, since the spy reads
    # /proc/PID/maps).
    class Site
      attr_reader :name, :root, :version

      # @param name [String] "host" or a script/rubies NAME
      def initialize(name)
        @name = name
        if host?
          @root = "/"
          @version = RUBY_VERSION
          @ruby = RbConfig.ruby
          @gem = File.join(RbConfig::CONFIG.fetch("bindir"), "gem")
        else
          line = IO.popen([File.join(ROOT, "script", "rubies"), "list"], &:read).lines.map(&:split)
                   .find { |fields| fields[0] == name }
          raise "#{name} is not built (script/rubies build #{name})" unless line

          @version, @root, @ruby = line[1..3]
          @on_host = line[4] != "chroot"
          # A Ruby built from source lives on the host, at its own prefix: nothing to chroot into.
          @root = "/" if @on_host
          @gem = @ruby.sub(%r{/ruby(?=[\d.]*\z)}, "/gem")
        end
      end

      def host?
        @name == "host"
      end

      # Runs on the host's filesystem (the host's Ruby, or a Ruby built from source there).
      def on_host?
        host? || @on_host
      end

      def series
        @version[/\A\d+\.\d+/]
      end

      # A fresh directory, as [path seen by this site's Ruby, path seen by the specs].
      def mktmpdir(prefix)
        base = on_host? ? Dir.tmpdir : File.join(@root, "tmp")
        host_path = Dir.mktmpdir(prefix, base)
        FileUtils.chmod(0o755, host_path)
        [on_host? ? host_path : host_path.delete_prefix(@root), host_path]
      end

      # +args+ run by this site's Ruby, with nothing from the host's environment but +env+
      # (so PATH holds no cargo and no C compiler unless +env+ says so).
      def ruby(*args, env: {})
        env = { "PATH" => "/nonexistent", "HOME" => "/tmp", "LC_ALL" => "C.UTF-8" }.merge(env)
        argv = ["/usr/bin/env", "-i", *env.map { |k, v| "#{k}=#{v}" }, @ruby, *args]
        return argv if on_host?

        ["unshare", "--mount", "--propagation", "private", "--", "/bin/sh", "-c",
         'mount -t proc proc "$0/proc" && exec chroot "$0" "$@"', @root, *argv]
      end

      # `gem install` of +gem_file+ into +gem_home+ (both as this site sees them).
      def gem_install(gem_file, gem_home, env: {})
        ruby(@gem, "install", "--local", "--no-document", "--install-dir", gem_home, gem_file,
             env: env)
      end

      # A process of this site's Ruby that can be read from inside the site (its pid is the
      # Ruby's: script/rubies run execs).
      def spawn_target(script, truth)
        cmd = if on_host?
                [host? ? RbConfig.ruby : @ruby, script, truth]
              else
                [File.join(ROOT, "script", "rubies"), "run", @name, "inside", "--", script, truth]
              end
        Process.spawn(*cmd, in: File::NULL, out: File::NULL, err: File::NULL)
      end
    end
  end
end
