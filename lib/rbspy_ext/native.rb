# frozen_string_literal: true

require "rbconfig"
require_relative "version"
require_relative "error"

module RubySpy
  # Finds the compiled extension for the running Ruby and loads it, or, where the gem was
  # installed without native code, the inert stand-ins of lib/rbspy_ext/unsupported.rb.
  #
  # Where the library can be, in the order tried:
  # 1. +lib/rbspy_ext/X.Y/rbspy_ext.so+: the platform gem carries one per Ruby series it was
  #    built for (+rake native+), and +script/rubies ext+ puts the chroot Rubies' there;
  # 2. +rbspy_ext/unsupported_platform.rb+: written by extconf.rb instead of compiling, where
  #    the spy cannot run (it holds the reason);
  # 3. +lib/rbspy_ext/rbspy_ext.so+, or +rbspy_ext/rbspy_ext.so+ on the load path: the source
  #    gem's build (+gem install+, +rake compile+).
  # @api private
  module Native
    # The running Ruby's series, as the platform gem names its directories.
    SERIES = RUBY_VERSION[/\A\d+\.\d+/]
    LIBRARY = "rbspy_ext.#{RbConfig::CONFIG.fetch('DLEXT')}"
    # What a user with a platform gem that lacks their Ruby installs instead.
    SOURCE_GEM = "gem install rbspy_ext --platform ruby (in a Gemfile: " \
                 "gem \"rbspy_ext\", force_ruby_platform: true)"

    class << self
      # Why the spy cannot run here, without loading any native code (the RSpec integration
      # asks before it loads anything).
      # @return [String, nil] nil where the extension is there to load
      def unsupported_reason
        kind, detail = resolve
        kind == :unsupported ? detail : nil
      end

      # The message {RubySpy::UnsupportedPlatform} carries.
      # @return [String]
      def unsupported_message
        "rbspy_ext cannot read processes on #{RUBY_PLATFORM}: #{unsupported_reason}. It was " \
          "installed without native code: RubySpy.tag runs its block with no effect, and " \
          "snapshot, attach, record and Profile.load raise this error."
      end

      # Loads the extension, or the stand-ins where the spy cannot run.
      # @return [void]
      # @raise [LoadError] naming the file and what to install when there is nothing to load,
      #   or the library there cannot be loaded
      def load!
        kind, detail = resolve
        case kind
        when :library then load_library(detail)
        when :unsupported then require_relative "unsupported"
        else raise LoadError, detail
        end
      end

      private

      def resolve
        @resolve ||= begin
          series = File.join(__dir__, SERIES, LIBRARY)
          if File.exist?(series)
            [:library, series]
          elsif (marker = feature("rbspy_ext/unsupported_platform"))
            require marker
            [:unsupported, UNSUPPORTED_REASON]
          elsif (built = feature("rbspy_ext/rbspy_ext", LIBRARY))
            [:library, built]
          elsif !RbConfig::CONFIG.fetch("host_os").include?("linux")
            [:unsupported, "it reads process memory with Linux's process_vm_readv"]
          else
            [:missing, missing_message]
          end
        end
      end

      # The path of +name+ in this gem's lib/ or on the load path (an installed gem's
      # extension directory), or nil.
      def feature(name, file = "#{File.basename(name)}.rb")
        here = File.join(__dir__, file)
        return here if File.exist?(here)

        $LOAD_PATH.resolve_feature_path(name)&.last
      rescue LoadError # Ruby < 3.1 raises where later ones return nil
        nil
      end

      def load_library(path)
        # dlopen maps a truncated library and then crashes the process (SIGBUS) touching the
        # part that is not there: refuse it first.
        problem = elf_problem(path)
        raise LoadError, "#{problem} - #{path}" if problem

        require path
      rescue LoadError => e
        raise LoadError, "rbspy_ext: cannot load #{path} (#{e.message}); reinstall the gem " \
                         "(gem pristine rbspy_ext) or, in a checkout, run rake compile"
      end

      # What makes +path+ unfit for dlopen that a look at its ELF headers shows: not a 64-bit
      # little-endian shared object, or shorter than what its program headers load.
      def elf_problem(path)
        File.open(path, "rb") do |f|
          size = f.size
          header = f.read(64).to_s
          return "not an ELF shared object" unless header.bytesize == 64 && header.start_with?("\x7FELF\x02\x01".b)

          type, = header.unpack("@16S<")
          phoff, = header.unpack("@32Q<")
          phentsize, phnum = header.unpack("@54S<S<")
          return "not a shared object (ELF type #{type})" unless type == 3
          return "truncated (program headers past the end)" if phoff + phentsize * phnum > size

          f.seek(phoff)
          table = f.read(phentsize * phnum).to_s
          phnum.times do |i|
            p_type, _flags, offset, _vaddr, _paddr, filesz = table.unpack("@#{i * phentsize}L<L<Q<Q<Q<Q<")
            return "truncated (#{size} bytes; a segment needs #{offset + filesz})" if p_type == 1 && offset + filesz > size
          end
          nil
        end
      rescue SystemCallError => e
        e.message
      end

      def missing_message
        carried = Dir[File.join(__dir__, "*", LIBRARY)].map { |f| File.basename(File.dirname(f)) }
        # Only the source gem and a checkout have ext/; the platform gem has none to build.
        if carried.empty? || File.exist?(File.join(__dir__, "..", "..", "ext", "rbspy_ext", "extconf.rb"))
          "rbspy_ext's compiled extension is missing (no #{File.join(__dir__, LIBRARY)}): in a " \
            "checkout run rake compile; otherwise reinstall the gem"
        else
          "rbspy_ext #{VERSION} for #{RbConfig::CONFIG.fetch('arch')} carries compiled " \
            "extensions for Ruby #{carried.sort_by { |s| s.split('.').map(&:to_i) }.join(', ')}, " \
            "not for Ruby #{RUBY_VERSION}; install the source gem, which compiles for this Ruby: " \
            "#{SOURCE_GEM}"
        end
      end
    end
  end
end
