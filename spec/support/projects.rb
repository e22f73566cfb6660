# frozen_string_literal: true

require "fileutils"
require "tmpdir"

module RubySpyTest
  # The fixture projects the test-framework integrations run (spec/fixtures/*_project).
  module Projects
    module_function

    # A path under the copy's output directory (tmp/rubyspy); needs @dir, the copy.
    def path(*parts)
      File.join(@dir, "tmp", "rubyspy", *parts)
    end

    # The files (not directories) written under tmp/rubyspy/+sub+ of the copy, sorted.
    def written(sub = "")
      dir = path(sub)
      Dir.exist?(dir) ? Dir.children(dir).reject { |f| File.directory?(File.join(dir, f)) }.sort : []
    end

    # Yields a fresh copy of spec/fixtures/<name>, with the CPU-bound Work module of
    # rspec_project/work.rb beside it (the projects share it), and removes it afterwards.
    def in_copy_of(name)
      fixtures = File.join(ROOT, "spec", "fixtures")
      Dir.mktmpdir(name) do |dir|
        FileUtils.cp_r(File.join(fixtures, name, "."), dir)
        FileUtils.cp(File.join(fixtures, "rspec_project", "work.rb"), dir)
        yield dir
      end
    end
  end
end
