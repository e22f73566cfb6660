# frozen_string_literal: true

require_relative "../lib/rbspy_ext/version"

desc "Build pkg/rbspy_ext-VERSION.gem"
task :gem do
  mkdir_p "pkg"
  sh "gem", "build", "rbspy_ext.gemspec", "--output", "pkg/rbspy_ext-#{RubySpy::VERSION}.gem"
end
