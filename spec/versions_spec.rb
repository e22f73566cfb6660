# frozen_string_literal: true

require_relative "spec_helper"
require "rbspy_ext"
require "etc"
require "open3"

# Version detection and overrides, against a live target (the Ruby set by
# RUBYSPY_TARGET_RUBY, or the host's).
RSpec.describe "RubySpy version handling" do
  let(:target) { RubySpyTest::Target.start("nested_methods") }

  after { target.stop }

  it "reports the version the target itself reports" do
    handle = RubySpy.attach(target.pid)
    expect(handle.ruby_version).to eq(target.ruby_version)
    expect(handle.warning).to be_nil
  end

  it "uses the newest known layout of the same minor series for a newer patch release, with a warning" do
    major, minor, = target.ruby_version.split(".")
    differs = RubySpy.attach(target.pid).layout[:differs]
    if differs&.any?
      # A build whose own debug information says the tables do not describe it (src-3.4-bp):
      # a table's layout, forced, is refused, never read into wrong frames.
      # (NotRubyProcess while the target is young, UnsupportedVersion past its start-up.)
      expect { RubySpy.attach(target.pid, force_version: "#{major}.#{minor}.99").snapshot }
        .to raise_error(RubySpy::Error, /not whole control frames/)
      next
    end
    handle = RubySpy.attach(target.pid, force_version: "#{major}.#{minor}.99")
    expect(handle.warning).to match(/#{major}\.#{minor}\.99 is newer than the layout table; using the layout of #{major}\.#{minor}\.\d+/)
    expect(handle.snapshot).to eq(RubySpy.snapshot(target.pid))
  end

  [["1.9.3", /1\.9\.3.*supported: Ruby 2\.7\.0 to 4\.\d+\.\d+, and newer patch releases/],
   ["5.0.0", /5\.0\.0.*supported: Ruby 2\.7\.0 to/],
   ["banana", /banana.*not a MAJOR\.MINOR\.PATCH version/],
   ["3.1", /not a MAJOR\.MINOR\.PATCH version/]].each do |version, message|
    it "raises UnsupportedVersion for force_version: #{version.inspect}, naming it" do
      expect { RubySpy.attach(target.pid, force_version: version) }
        .to raise_error(RubySpy::UnsupportedVersion, message)
      expect(target.health_problems).to eq([])
    end
  end

  # A layout that does not fit a Ruby past its start-up (2 s, see attach.rs) is reported as
  # such, naming the Ruby by its own RUBY_DESCRIPTION (with its revision, and a dev build's date) and
  # the Rubies this build knows: never "not a Ruby process", never garbage frames. Forced here
  # with the layouts of other series, as an unknown release's guessed layout would be.
  it "names the Ruby, its revision and the Rubies it knows when the forced layout does not fit" do
    series = target.ruby_version[0, 3]
    wrong = %w[2.7.4 3.1.2 3.3.8 3.4.11 4.0.2].reject { |v| v[0, 3] == series }
    revision, = Open3.capture2(*RubySpyTest::TargetRuby.current.command("-e", "print RUBY_REVISION[0, 10]"))
    wait_for("the target to be past its start-up") { process_age(target.pid) > 2.2 }
    own = RubySpy.snapshot(target.pid)
    refused = wrong.select do |version|
      frames = RubySpy.attach(target.pid, force_version: version).snapshot
      # A neighbouring series' layout may fit this Ruby as well (3.4's fits 3.3 here): then
      # its frames must be this Ruby's own, never garbage (labelled as the forced release
      # labels them: 3.4 qualifies `sleep` as `Kernel#sleep`).
      where = ->(list) { list.map { |f| [f.path, f.lineno, f.base_label] } }
      expect(where.call(frames)).to eq(where.call(own)), "the forced layout of #{version} gave other frames"
      false
    rescue RubySpy::UnsupportedVersion => e
      expect(e.message).to include("ruby #{target.ruby_version}", "forced layout of #{version}",
                                   "this build knows Ruby 2.7.0-2.7.")
      # (A build from a tree with no revision.h, as 3.2 and 4.0 here, says HEAD and names none.)
      expect(e.message).to include(revision) unless revision == "HEAD"
      true
    end
    expect(refused).not_to be_empty
    expect(target.health_problems).to eq([])
  end
end
