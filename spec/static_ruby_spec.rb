# frozen_string_literal: true

require_relative "spec_helper"
require "fileutils"
require "rbspy_ext"
require "tmpdir"

# Statically linked Rubies (`--disable-shared`, rbenv's and ruby-build's default: the VM is in
# the executable, which exports `ruby_version` but hides `ruby_current_vm_ptr` and
# `ruby_global_symbols` in its `.symtab`): the source builds of script/rubies (3.3.8 and 3.4.5,
# as rbenv builds them) and any static Ruby of RUBYSPY_EXTRA_RUBIES, as installed and as a copy
# run through `strip --strip-all`, which leaves only `.dynsym`. Either way the snapshot must equal the target's own backtrace_locations, or fail
# with a RubySpy::Error; never garbage frames.
RSpec.describe "statically linked Rubies" do

  statics = IO.popen([File.join(RubySpyTest::ROOT, "script", "rubies"), "list"], &:read).lines
              .map(&:split).select { |f| %w[source extra].include?(f[4]) && Dir[File.join(f[2], "lib", "libruby.so*")].empty? }

  if statics.empty?
    it "has static Rubies to run (script/rubies build builds them from Debian's source tarballs)" do
      skip "no static Ruby built: script/rubies build src-3.3 src-3.4"
    end
  end

  statics.each do |name, version, _dir, bin|
    describe "Ruby #{version} (#{name})" do
      it "reads the installed executable, through its .symtab, exactly" do
        symtab = IO.popen(["readelf", "-W", "-s", bin], &:read)
        expect(symtab).to match(/ ruby_current_vm_ptr$/)
        target = start_target("nested_methods", ruby: RubySpyTest::BinaryRuby.new(bin))
        expect(RubySpy.snapshot(target.pid)).to match_backtrace(target.frames, ruby_version: target.ruby_version)
      end

      it "reads a copy stripped with strip --strip-all exactly (the VM and symbols found by scanning)" do
        Dir.mktmpdir("rbspy-stripped-") do |dir|
          stripped = File.join(dir, "ruby")
          FileUtils.cp(bin, stripped)
          system("strip", "--strip-all", stripped, exception: true)
          expect(IO.popen(["readelf", "-W", "-S", stripped], &:read)).not_to include(".symtab")

          target = start_target("nested_methods", ruby: RubySpyTest::BinaryRuby.new(stripped))
          handle = RubySpy.attach(target.pid)
          expect(handle.ruby_version).to eq(version)
          expect(handle.snapshot).to match_backtrace(target.frames, ruby_version: target.ruby_version)
          threads = handle.thread_snapshots
          expect(threads.map { |t| t[:tid] }).to include(target.pid)
        end
      end
    end
  end
end
