# frozen_string_literal: true

module RubySpyTest
  ROOT = File.expand_path("../..", __dir__)
  FIXTURES = File.join(ROOT, "spec", "fixtures")
end
