# frozen_string_literal: true

require_relative "spec_helper"
require "rbspy_ext"

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

  it "raises a RubySpy::Error (not a crash) when the forced layout does not fit the process" do
    known = %w[2.7.4 3.1.2 3.3.8 3.4.11]
    wrong = known.find { |v| v[0, 3] != target.ruby_version[0, 3] }
    expect { RubySpy.attach(target.pid, force_version: wrong).snapshot }
      .to raise_error(RubySpy::Error, /#{target.pid}/)
    expect(target.health_problems).to eq([])
  end
end
